"""Every environment variable disttrain reads or writes, declared once with its meaning.

    from disttrain import envvars
    envvars.restart_count()                      # torchrun's restart round, 0 on the first
    envvars.set_env(envvars.OMP_NUM_THREADS, "4")  # logs when it replaces another value

A name used anywhere in the package is a constant of this module, so a grep for it lands
here, with what it means and who sets it; `docs/environment.md` lists the same table (a
test keeps the two equal). Literals remain in `verify/verify_checks.py`, which is shipped
alone into pods whose image has torch but not disttrain, and in tables that mirror another
contract: the NCCL presets of `k8s/hami.py` (a test checks their names against this
module), the training operator's variables that `k8s run-local` emulates, and the lint
rules about a user's own script (`diagnose/`).

Readers take an optional mapping (default `os.environ`) so that they can be tested without
touching the process environment. A variable that is set but malformed is an error naming
it, never a silent default. Writes go through `set_env`, which logs a warning when it
replaces a value that was already there (the user's, most likely): a worker that silently
runs with other settings than the shell shows is hard to debug.

The launch contract itself (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) is parsed inside a rank by `disttrain.distributed.env` alone, with the
names declared here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field

from disttrain.errors import DistEnvError

log = logging.getLogger("disttrain")

# Who sets a variable, as the docs group them.
YOU = "you"                  # a switch for users (or tests) of disttrain
DISTTRAIN = "disttrain"      # written by disttrain for its own child processes
LAUNCHER = "launcher"        # the per-rank contract: torchrun, disttrain's launchers, a pod
TORCHRUN = "torchrun"        # torchrun's elastic agent, for its workers
POD = "pod"                  # written into rendered or emulated pods
HOST = "host"                # the machine's own settings that disttrain consults
SETTERS = (YOU, DISTTRAIN, LAUNCHER, TORCHRUN, POD, HOST)


@dataclass(frozen=True)
class EnvVar:
    """One declared variable: its name, who sets it, and what it does (one line)."""

    name: str
    setter: str
    meaning: str


VARS: dict[str, EnvVar] = {}


def _var(name: str, setter: str, meaning: str) -> str:
    """Declare `name` once; returns it, so that the constant is the plain string."""
    assert name not in VARS and setter in SETTERS, name
    VARS[name] = EnvVar(name, setter, meaning)
    return name


# -- disttrain's own -------------------------------------------------------------------------
WATCHDOG = _var("DISTTRAIN_WATCHDOG", YOU,
                "any value keeps rank 0's in-job stall watchdog off; `disttrain run` sets "
                "`launcher` while its own watchdog runs, `off` turns it off by hand")
COMM_WAIT = _var("DISTTRAIN_COMM_WAIT", YOU,
                 "how a rank waits for its step's last gloo all-reduce: `auto` (default: poll "
                 "only with a free core per rank), `poll` or `block` (docs/performance.md)")
NO_MALLOPT = _var("DISTTRAIN_NO_MALLOPT", YOU,
                  "any value: leave glibc malloc's thresholds alone in each rank")
NO_LOSS_PNG = _var("DISTTRAIN_NO_LOSS_PNG", YOU,
                   "any value: a run ends without drawing loss.png (about 1 s of a core on "
                   "rank 0, mostly matplotlib's import); `disttrain report RUN_DIR` draws the "
                   "loss later. The test suite sets it")
FSDP_VERSION = _var("DISTTRAIN_FSDP_VERSION", YOU,
                    "`1` forces FSDP1 even where torch has fully_shard (FSDP2)")
FAULT = _var("DISTTRAIN_FAULT", YOU,
             "testing only: `ACTION:rank=R:step=S[:phase=P][:restart=N]` makes that rank fail "
             "at that step (docs/resilience.md); several, comma-separated, each for its own "
             "rank and restart round, chain failures in one job; `slow-compute:rank=R:factor=F` or "
             "`slow-data:rank=R:ms=M` makes it a straggler (docs/performance.md)")
VERIFY_FAULT = _var("DISTTRAIN_VERIFY_FAULT", YOU,
                    "testing only: `<check>:<rank>[,...]` makes `disttrain verify` fail those "
                    "checks on those ranks (docs/verify-and-bench.md)")
T0 = _var("DISTTRAIN_T0", DISTTRAIN,
          "the `disttrain` command's start time (epoch seconds), so workers report "
          "time-to-first-step; kept for child commands, dropped by the benchmarks")
RUN_DIR = _var("DISTTRAIN_RUN_DIR", DISTTRAIN,
               "the run directory `disttrain run SCRIPT` made for this attempt; "
               "`disttrain.fit()` in the script writes there unless its spec sets train.run_dir")
WARM_TASK = _var("DISTTRAIN_WARM_TASK", DISTTRAIN,
                 "JSON reference and task_args of a built-in task, whose data the warm fork "
                 "server loads once for all local workers")
TEST_TIMEOUT_S = _var("DISTTRAIN_TEST_TIMEOUT_S", DISTTRAIN,
                      "`disttrain.testing.run_ranks`' timeout, which bounds every collective "
                      "of `setup_for_test` (default 60)")

# -- the per-rank launch contract ------------------------------------------------------------
RANK = _var("RANK", LAUNCHER, "this process's global rank, 0..WORLD_SIZE-1")
WORLD_SIZE = _var("WORLD_SIZE", LAUNCHER, "the number of ranks in the job")
LOCAL_RANK = _var("LOCAL_RANK", LAUNCHER, "this process's rank on its node; picks its GPU")
LOCAL_WORLD_SIZE = _var("LOCAL_WORLD_SIZE", LAUNCHER, "the number of ranks on this node")
MASTER_ADDR = _var("MASTER_ADDR", LAUNCHER, "the host of rank 0's rendezvous store")
MASTER_PORT = _var("MASTER_PORT", LAUNCHER, "the TCP port of rank 0's rendezvous store")
LAUNCH_CONTRACT = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

# -- torchrun's elastic agent ----------------------------------------------------------------
RESTART_COUNT = _var("TORCHELASTIC_RESTART_COUNT", TORCHRUN,
                     "how many times the agent restarted the workers (0 on the first round); "
                     "above 0 the built-in job resumes from its last checkpoint")
ERROR_FILE = _var("TORCHELASTIC_ERROR_FILE", TORCHRUN,
                  "where a worker records its error for the agent's failure summary")
USE_AGENT_STORE = _var("TORCHELASTIC_USE_AGENT_STORE", TORCHRUN,
                       "`True` when the workers share the agent's store, whose keys each "
                       "restart round must keep apart")
GROUP_RANK = _var("GROUP_RANK", TORCHRUN,
                  "this worker's node rank (the agent's place in the rendezvous); ranks.json lists it")
RUN_ID = _var("TORCHELASTIC_RUN_ID", TORCHRUN,
              "the job's rendezvous id (`--rdzv_id`); the job name in a script rank's process "
              "title; set, it marks a worker of the agent, a one-rank job's too (own session, title)")

SPT_NOENV = _var("SPT_NOENV", DISTTRAIN,
                 "`1` while a rank sets its process title: `setproctitle` then keeps "
                 "/proc/PID/environ readable (the title fits the original command line)")
SHARE_RDZV_STORE_OFF = _var("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", POD,
                            "`1` in pods a Job re-creates (launch.max_restarts > 0): a fresh "
                            "torchrun agent rejoining a surviving one's rendezvous would else "
                            "wait for the round's MASTER_ADDR, which the survivor never republishes")

# -- written for workers and pods ------------------------------------------------------------
OMP_NUM_THREADS = _var("OMP_NUM_THREADS", DISTTRAIN,
                       "threads per rank: the train.threads setting, else cores / local ranks")
PYTHONUNBUFFERED = _var("PYTHONUNBUFFERED", POD,
                        "`1` so that `kubectl logs -f` and benchmarks see output as it comes")
TORCH_ELASTIC_SHUTDOWN_TIMEOUT = _var(
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", POD,
    "seconds torchrun waits after forwarding SIGTERM before it SIGKILLs the workers: "
    "`launch.stop_grace_s` in rendered pods (a torch that does not read it waits 30 s)")
STOP_RECORD = _var("DISTTRAIN_STOP_RECORD", POD,
                   "RUN_DIR/stop.json in a built-in job's pods: written there while the pod ran, "
                   "it makes the pod exit 75 (stopped, resumable) like a signalled one "
                   "(k8s/stopping.py)")
PYTHONPATH = _var("PYTHONPATH", POD,
                  "`k8s run-local` puts this disttrain first, so emulated pods import it")
NCCL_SOCKET_IFNAME = _var("NCCL_SOCKET_IFNAME", POD,
                          "the network interface NCCL uses: `cluster.nccl_socket_ifname`; "
                          "`disttrain doctor` checks it exists")
GLOO_SOCKET_IFNAME = _var("GLOO_SOCKET_IFNAME", HOST,
                          "the network interface gloo uses; `disttrain doctor` checks it exists")
NCCL_DEBUG = _var("NCCL_DEBUG", POD, "`INFO` with `cluster.nccl_preset: debug`")
NCCL_IB_DISABLE = _var("NCCL_IB_DISABLE", POD,
                       "`1` with the `no-ib` preset, `0` with `ib` (InfiniBand off / on)")
NCCL_NET_GDR_LEVEL = _var("NCCL_NET_GDR_LEVEL", POD, "`2` with the `ib` preset (GPUDirect RDMA)")
NCCL_P2P_DISABLE = _var("NCCL_P2P_DISABLE", POD,
                        "`1` with the `no-p2p` preset or vGPU workaround (no NVLink / PCIe P2P)")
NCCL_SHM_DISABLE = _var("NCCL_SHM_DISABLE", POD,
                        "`1` with the `no-shm` vGPU workaround (no shared-memory transport)")
NCCL_CUMEM_HOST_ENABLE = _var("NCCL_CUMEM_HOST_ENABLE", POD,
                              "`0` with the `no-cumem-host` vGPU workaround; `disttrain doctor` "
                              "checks it under HAMi")
CUDA_DISABLE_CONTROL = _var("CUDA_DISABLE_CONTROL", POD,
                            "`true` with the `no-vgpu-control` vGPU workaround: HAMi-core's memory "
                            "and core isolation off for the container (last resort)")

# -- read from the machine -------------------------------------------------------------------
CUDA_VISIBLE_DEVICES = _var("CUDA_VISIBLE_DEVICES", HOST,
                            "empty or `-1` means no GPU: `nproc_per_node: auto` counts none")
CUDA_DEVICE_SM_LIMIT = _var("CUDA_DEVICE_SM_LIMIT", HOST,
                            "HAMi's share of the GPU's cores for this container (percent); "
                            "reported by `disttrain env`")
CUDA_DEVICE_MEMORY_LIMIT = _var("CUDA_DEVICE_MEMORY_LIMIT", HOST,
                                "HAMi's GPU memory limit for this container (N[k/m/g], bytes when "
                                "bare; `_<i>` for device i); shown by `disttrain top` and `env`")
CUDA_OVERSUBSCRIBE = _var("CUDA_OVERSUBSCRIBE", HOST,
                          "`true` when HAMi lets this container oversubscribe GPU memory; "
                          "reported by `disttrain env`")
KUBECONFIG = _var("KUBECONFIG", HOST, "the cluster config the `k8s` commands use")

# -- written for the libraries the fine-tuning recipe uses -----------------------------------
HF_HUB_OFFLINE = _var("HF_HUB_OFFLINE", DISTTRAIN,
                      "`1` in the causal-LM recipe's ranks (disttrain.recipes): huggingface_hub "
                      "never calls the network, a missing file is an error (docs/finetune.md)")
TRANSFORMERS_OFFLINE = _var("TRANSFORMERS_OFFLINE", DISTTRAIN,
                            "`1` in the causal-LM recipe's ranks, for transformers releases "
                            "that read it rather than HF_HUB_OFFLINE")


# -- readers ---------------------------------------------------------------------------------
def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when `name` is set to anything but the empty string (the on/off switches)."""
    return bool(_env(environ).get(name))


def int_var(name: str, default: int, minimum: int = 0,
            environ: Mapping[str, str] | None = None) -> int:
    """An integer variable; unset or empty means `default`.

    Raises:
        DistEnvError: the value is not an integer, or is below `minimum`; names the variable.
    """
    raw = _env(environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DistEnvError(f"{name}={value} must be >= {minimum}")
    return value


def float_var(name: str, default: float | None,
              environ: Mapping[str, str] | None = None) -> float | None:
    """A number variable; unset or empty means `default`.

    Raises:
        DistEnvError: the value is not a number; names the variable.
    """
    raw = _env(environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not a number") from None


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """torchrun's restart round of this worker: 0 first, then 1, 2, ... (0 outside torchrun).

    Raises:
        DistEnvError: TORCHELASTIC_RESTART_COUNT is not a whole number.
    """
    return int_var(RESTART_COUNT, 0, 0, environ)


def uses_agent_store(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun's workers share its agent's store (its default since torch 2.4)."""
    return _env(environ).get(USE_AGENT_STORE) == "True"


def started_by_agent(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker that torch's elastic agent started (torchrun, `disttrain run`): the
    agent sets TORCHELASTIC_RUN_ID for every worker, a one-rank job's too, whose RANK=0 and
    WORLD_SIZE=1 look like a plain `python script.py`."""
    return bool(_env(environ).get(RUN_ID))


def comm_wait(environ: Mapping[str, str] | None = None) -> str:
    """DISTTRAIN_COMM_WAIT: `auto` (unset or empty), `poll` or `block`.

    Raises:
        DistEnvError: any other value; names the variable and the choices.
    """
    raw = _env(environ).get(COMM_WAIT) or "auto"
    if raw not in ("auto", "poll", "block"):
        raise DistEnvError(f"{COMM_WAIT}={raw!r}: use auto, poll or block")
    return raw


def launch_t0(environ: Mapping[str, str] | None = None) -> float | None:
    """The `disttrain` command's start time, or None when no disttrain command started us.

    Raises:
        DistEnvError: DISTTRAIN_T0 is not a number.
    """
    return float_var(T0, None, environ)


def launcher_run_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The run directory `disttrain run SCRIPT` made for the script's ranks, or None."""
    return _env(environ).get(RUN_DIR) or None


def ranks_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """The collective timeout `run_ranks` set for its ranks (60 s outside it).

    Raises:
        DistEnvError: DISTTRAIN_TEST_TIMEOUT_S is not a number.
    """
    value = float_var(TEST_TIMEOUT_S, 60.0, environ)
    assert value is not None
    return value


def fsdp1_forced(environ: Mapping[str, str] | None = None) -> bool:
    """True when DISTTRAIN_FSDP_VERSION=1 asks for FSDP1 where FSDP2 exists."""
    return _env(environ).get(FSDP_VERSION) == "1"


@dataclass(frozen=True)
class HamiLimits:
    """The vGPU limits HAMi's device plugin put into this container's environment
    (HAMi-core enforces them; docs/cluster.md)."""

    sm_limit_percent: int | None = None             # CUDA_DEVICE_SM_LIMIT
    memory_limit_mib: dict[str, int | None] = field(default_factory=dict)   # per device index
    default_memory_limit_mib: int | None = None     # CUDA_DEVICE_MEMORY_LIMIT

    def describe(self, device_index: int) -> str | None:
        """`HAMi CUDA_DEVICE_SM_LIMIT=30%, gpumem 4096 MiB` for that device, None without limits."""
        parts = []
        if self.sm_limit_percent is not None:
            parts.append(f"{CUDA_DEVICE_SM_LIMIT}={self.sm_limit_percent}%")
        mem = self.memory_limit_mib.get(str(device_index)) or self.default_memory_limit_mib
        if mem:
            parts.append(f"gpumem {mem} MiB")
        return "HAMi " + ", ".join(parts) if parts else None


_MEMORY_LIMIT = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)\s*$")
_UNIT = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_memory_limit(value: str) -> int | None:
    """HAMi-core's CUDA_DEVICE_MEMORY_LIMIT syntax: N[k|m|g] (bare = bytes); 0 = none.
    None also for a value HAMi-core would not read."""
    m = _MEMORY_LIMIT.match(value or "")
    if not m:
        return None
    return int(m.group(1)) * _UNIT[m.group(2).lower()]


def hami_limits(environ: Mapping[str, str] | None = None) -> HamiLimits:
    """The HAMi limits in the environment: the SM share (CUDA_DEVICE_SM_LIMIT) and the
    memory limits, per device (CUDA_DEVICE_MEMORY_LIMIT_<i>) and for all (no suffix)."""
    env = _env(environ)
    per_device: dict[int, int | None] = {}
    for key, value in env.items():
        m = re.fullmatch(rf"{CUDA_DEVICE_MEMORY_LIMIT}_(\d+)", key)
        if m:
            per_device[int(m.group(1))] = parse_memory_limit(value)
    default = parse_memory_limit(env[CUDA_DEVICE_MEMORY_LIMIT]) if CUDA_DEVICE_MEMORY_LIMIT in env else None
    sm = env.get(CUDA_DEVICE_SM_LIMIT)
    return HamiLimits(
        sm_limit_percent=int(sm) if sm and sm.strip().isdigit() else None,
        memory_limit_mib={str(i): (b // 2**20 if b else None) for i, b in sorted(per_device.items())},
        default_memory_limit_mib=default // 2**20 if default else None)


# -- writers ---------------------------------------------------------------------------------
def set_env(name: str, value: str, environ: MutableMapping[str, str] | None = None) -> None:
    """`environ[name] = value`, with a warning when that replaces a different value.

    The replaced value was most likely the user's own (an exported OMP_NUM_THREADS, RANK
    left in the shell): saying so beats a worker that silently runs otherwise.
    """
    env = os.environ if environ is None else environ
    old = env.get(name)
    if old is not None and old != value:
        log.warning("disttrain sets %s=%s for its workers (it was %s)", name, value, old)
    env[name] = value


@contextlib.contextmanager
def set_while(name: str, value: str,
              environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """`set_env(name, value)` for the duration of a block; the previous value (or its
    absence) is put back afterwards."""
    env = os.environ if environ is None else environ
    saved = env.get(name)
    set_env(name, value, env)
    try:
        yield
    finally:
        if saved is None:
            env.pop(name, None)
        else:
            env[name] = saved
