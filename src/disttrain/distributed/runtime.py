"""Process-group lifecycle from the launcher's environment, device binding, rank helpers.

    from disttrain.distributed import runtime
    with runtime.setup(backend="auto", timeout_s=300) as rt:
        model = model.to(rt.device)
        rt.print0("only rank 0 prints this")

This is the only module that reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (seed 000 §2.2). torchrun sets all of them; `python
train.py` with none of them set is a single process (world size 1). A variable that is
set but malformed is an error naming it, never a silent default.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import logging
import os
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disttrain.errors import DistEnvError
from disttrain.resilience.heartbeat import collective_timeout_s

log = logging.getLogger("disttrain")

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")



@dataclass(frozen=True)
class DistEnv:
    """What the launcher told this process about its place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def launched(self) -> bool:
        """True when started by a launcher (torchrun, spawn helper, env), not plain python."""
        return self.world_size > 1 or self.rank > 0


def _int_var(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise DistEnvError(f"{name} is not set; launch with torchrun (or `disttrain run`), "
                               f"or export {name} as seed 000 §5.2 way 3 shows")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DistEnvError(f"{name}={value} must be >= {minimum}")
    return value


def read_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Parse the launcher's variables; none set at all means a single process.

    Raises:
        DistEnvError: a variable is malformed, or some are set and a required one is not.
    """
    env = os.environ if env is None else env
    if not any(env.get(v) for v in ("RANK", "WORLD_SIZE")):
        return DistEnv()
    world = _int_var(env, "WORLD_SIZE", None, 1)
    rank = _int_var(env, "RANK", None, 0)
    if rank >= world:
        raise DistEnvError(f"RANK={rank} must be < WORLD_SIZE={world}")
    local_rank = _int_var(env, "LOCAL_RANK", 0 if world == 1 else rank, 0)
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", world, 1)
    if local_rank >= local_world:
        raise DistEnvError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world}")
    addr = env.get("MASTER_ADDR") or ""
    if world > 1 and not addr:
        raise DistEnvError("MASTER_ADDR is not set; export the rank-0 host, e.g. "
                           "MASTER_ADDR=localhost")
    port = _int_var(env, "MASTER_PORT", None if world > 1 else 29500, 1)
    if port > 65535:
        raise DistEnvError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return DistEnv(rank, world, local_rank, local_world, addr or "127.0.0.1", port)


def resolve_backend(requested: str, local_world_size: int, cuda_devices: int | None = None) -> str:
    """`auto` -> nccl when every local rank can have its own CUDA device, else gloo."""
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise DistEnvError("backend nccl needs CUDA GPUs and none is visible; "
                               "use --backend gloo (or auto) on CPU")
        return requested
    n = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    return "nccl" if n >= local_world_size >= 1 and n > 0 else "gloo"


def tune_allocator() -> bool:
    """Pin glibc malloc's mmap/trim thresholds so freed gradient buffers are reused.

    By default glibc adapts these thresholds per process, and a training step's ~MB-sized
    buffers are often handed back to the OS and page-faulted in again every step
    (x1.5-1.8 step time on small models; shared/reference/perf-baseline.md). mallopt at
    run time has the same effect as GLIBC_TUNABLES, also in forked workers.
    """
    if os.environ.get("DISTTRAIN_NO_MALLOPT") or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        ok &= libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and all GPUs) with `seed`."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible seed per rank for data workers and augmentation (seed 002)."""
    return (seed * 1_000_003 + rank * 7919 + 1) % 2**31


@dataclass
class Runtime:
    """A live process group (or a single process) and the device this rank uses."""

    env: DistEnv
    backend: str
    device: torch.device
    timeout_s: float
    owns_group: bool = False

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        """Wait for all ranks (bounded by the process group's timeout)."""
        if self.distributed and self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def print0(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only (seed 000 appendix A: log only on rank 0)."""
        if self.is_rank0:
            print(*args, **kwargs, flush=True)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self) -> None:
        """Destroy the process group this runtime created (idempotent)."""
        if self.owns_group and self.distributed:
            dist.destroy_process_group()
        self.owns_group = False

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _agent_store_restart() -> int | None:
    """torchrun's restart round when the workers share its agent's store, else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def _round_store(denv: DistEnv, restart: int, timeout: datetime.timedelta) -> Any:
    """The agent's store under a prefix of this restart round (issue 7).

    torchrun's agent keeps one TCPStore across restarts (static rendezvous caches it)
    and init_process_group's keys (gloo addresses, the NCCL unique id) are the same in
    every round, so a restarted rank can read the dead round's value and fail with
    "Connection refused" (pytorch#135712, #167288). A prefix per round keeps them apart.
    """
    store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"disttrain/round_{restart}", store)


def setup(backend: str = "auto", timeout_s: float = 300.0, seed: int | None = None,
          env: Mapping[str, str] | None = None, threads: int | None = None) -> Runtime:
    """Create the process group from the launcher's env and bind this rank's device.

    Args:
        backend: "auto", "nccl" or "gloo".
        timeout_s: stall timeout; collectives time out after it plus a small grace
            (`heartbeat.collective_timeout_s`), so a rank stuck longer fails instead of
            hanging (torch's default is 30 minutes, far too long to notice a dead peer),
            and disttrain's launcher watchdog names the stuck rank first.
        seed: when given, seed all RNGs with it (the same on every rank, so models
            start identical; use `rank_seed` for per-rank data randomness).
        env: the environment to read (default os.environ).
        threads: torch intra-op threads; default: cores / local processes.

    Returns:
        A Runtime; use it as a context manager to destroy the group at the end.

    Example:
        >>> with setup("gloo") as rt:
        ...     rt.print0(rt.rank, rt.world_size)
    """
    denv = read_env(env)
    tune_allocator()
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // denv.local_world_size)
    torch.set_num_threads(threads)
    name = resolve_backend(backend, denv.local_world_size)
    if name == "nccl":
        if denv.local_rank >= torch.cuda.device_count():
            raise DistEnvError(f"LOCAL_RANK={denv.local_rank} but only "
                               f"{torch.cuda.device_count()} CUDA devices are visible")
        device = torch.device("cuda", denv.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if seed is not None:
        seed_everything(seed)
    owns = False
    if dist.is_available() and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=collective_timeout_s(timeout_s))
        if denv.launched:
            kwargs: dict[str, Any] = {}
            if name == "nccl":
                kwargs["device_id"] = device
            # env:// under torchrun reuses the agent's TCPStore (no second port to bind);
            # an explicit env mapping (tests, the spawn launcher) gets a tcp:// store.
            method = ("env://" if env is None
                      else f"tcp://{denv.master_addr}:{denv.master_port}")
            restart = _agent_store_restart() if env is None else None
            if restart is not None:
                kwargs["store"] = _round_store(denv, restart, timeout)
            else:
                kwargs["init_method"] = method
            dist.init_process_group(name, rank=denv.rank, world_size=denv.world_size,
                                    timeout=timeout, **kwargs)
        else:
            # One process: a private in-memory store, no port needed.
            dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        owns = True
    log.debug("rank %d/%d backend=%s device=%s", denv.rank, denv.world_size, name, device)
    return Runtime(denv, name, device, timeout_s, owns)


# -- `python train.py --world-size N --rank R` (seed 002's verification command) ----------
def add_dist_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let a user script take its place in the job from flags instead of torchrun's env.

    Adds --world-size, --rank, --master-addr, --master-port, --backend, and (hidden)
    --local-rank/--local_rank, which the deprecated `python -m torch.distributed.launch`
    passes; under torchrun none of them is needed. Use with `setup_from_args`.

    Example:
        >>> parser = add_dist_args(argparse.ArgumentParser())
        >>> args = parser.parse_args()              # python train.py --world-size 4 --rank 0
        >>> with setup_from_args(args) as rt:
        ...     rt.print0(rt.rank, rt.world_size)
    """
    g = parser.add_argument_group("distributed (disttrain.distributed.runtime)")
    g.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="processes in the job (default: WORLD_SIZE from the launcher, else 1)")
    g.add_argument("--rank", type=int, default=None, metavar="R",
                   help="this process's rank, 0..N-1 (default: RANK from the launcher)")
    g.add_argument("--master-addr", default=None, help="rank 0's host (default MASTER_ADDR or 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rank 0's rendezvous port (default MASTER_PORT or 29500)")
    g.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="auto = nccl when every local rank has a GPU, else gloo")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return parser


def env_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None
                  ) -> dict[str, str] | None:
    """The launcher env contract (RANK, WORLD_SIZE, ...) with the flags applied on top.

    Returns None when no flag was given, so `setup` reads the real environment (torchrun).
    One host is assumed for LOCAL_RANK / LOCAL_WORLD_SIZE unless the env says otherwise.

    Raises:
        DistEnvError: only one of --world-size / --rank, or a rank outside the world.
    """
    base = dict(os.environ if env is None else env)
    world, rank, local = args.world_size, args.rank, args.local_rank
    if world is None and rank is None:
        if local is None:
            return None
        base["LOCAL_RANK"] = str(local)  # torch.distributed.launch: the rest is in the env
        return base
    world = world if world is not None else _int_var(base, "WORLD_SIZE", None, 1)
    if rank is None:
        if "RANK" not in base:
            raise DistEnvError(
                f"--world-size {world} needs --rank R (0..{world - 1}) for this process; to "
                f"start all {world} ranks here use `torchrun --nproc_per_node {world} "
                f"train.py` or `disttrain run train.py --nproc-per-node {world}`")
        rank = _int_var(base, "RANK", None, 0)
    if world < 1 or not 0 <= rank < world:
        raise DistEnvError(f"--rank {rank} must be in 0..{world - 1} (--world-size {world})")
    base.update({
        "WORLD_SIZE": str(world), "RANK": str(rank),
        "LOCAL_RANK": str(local if local is not None else base.get("LOCAL_RANK", rank)),
        "LOCAL_WORLD_SIZE": base.get("LOCAL_WORLD_SIZE", str(world)),
        "MASTER_ADDR": args.master_addr or base.get("MASTER_ADDR") or "127.0.0.1",
        "MASTER_PORT": str(args.master_port or base.get("MASTER_PORT") or 29500),
    })
    return base


def setup_from_args(args: argparse.Namespace, timeout_s: float = 300.0, seed: int | None = None,
                    threads: int | None = None) -> Runtime:
    """`setup()` for a script parsed with `add_dist_args` (flags override the env)."""
    return setup(args.backend, timeout_s=timeout_s, seed=seed, env=env_from_args(args),
                 threads=threads)
