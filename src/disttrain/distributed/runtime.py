"""The process group of this rank: create it from the launcher's env, bind the device, end it.

    from disttrain.distributed import runtime
    with runtime.setup(backend="auto", timeout_s=300) as rt:
        model = model.to(rt.device)
        rt.print0("only rank 0 prints this")

`setup` reads this process's place in the job (`distributed.env`), makes the per-process
settings (`distributed.process`: allocator, threads, seed), chooses the backend and device,
and creates the group with a collective timeout derived from the stall timeout
(`collective_timeout_s`), so a rank waiting for a dead peer fails instead of hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disttrain import envvars
from disttrain.distributed.env import DistEnv, env_from_args, read_env
from disttrain.distributed.process import own_session, seed_everything, threads_per_rank, tune_allocator
from disttrain.errors import DistEnvError
from disttrain.resilience.proctitle import set_rank_title

log = logging.getLogger("disttrain")


def collective_timeout_s(timeout_s: float) -> float:
    """The process group's timeout: `timeout_s` plus a grace (10 %, 2 s to 30 s).

    The grace lets the watchdog name the stuck rank before a rank waiting for it times
    out in the collective; without a watchdog (plain torchrun) the job still ends then.
    """
    return timeout_s + min(30.0, max(2.0, 0.1 * timeout_s))


def resolve_backend(requested: str, local_world_size: int, cuda_devices: int | None = None) -> str:
    """`auto` -> nccl when every local rank can have its own CUDA device, else gloo."""
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise DistEnvError("backend nccl needs CUDA GPUs and none is visible; "
                               "use --backend gloo (or auto) on CPU")
        return requested
    n = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    return "nccl" if n >= local_world_size >= 1 and n > 0 else "gloo"


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
        """print() on rank 0 only: N ranks printing the same line bury the one that differs."""
        if self.is_rank0:
            print(*args, **kwargs, flush=True)

    @property
    def store_address(self) -> tuple[str, int] | None:
        """(host, port) of the job's c10d store when launched ranks share one, else None.

        The heartbeat publishes there (`resilience.heartbeat.start`); a single process
        has only a private in-memory store nobody else can read.
        """
        if self.distributed and self.world_size > 1 and self.env.launched:
            return self.env.master_addr, self.env.master_port
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a collective; [obj] in a single process)."""
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self) -> None:
        """Destroy the process group this runtime created (idempotent).

        The groups leave torch's registry here, but their objects are kept alive
        (`_retire_groups`), so that the last Python reference to one (a DDP Reducer freed
        later, or destroy itself) never runs gloo's destructor under the GIL. On gloo it
        then waits until gloo's worker threads have freed their finished collectives
        (`gloo_drain`): one that does so while the interpreter ends aborts the process.
        """
        if self.owns_group and self.distributed:
            _retire_groups()
            dist.destroy_process_group()
            if self.backend == "gloo":   # before the interpreter may end (distributed/gloo_drain.py)
                from disttrain.distributed.gloo_drain import wait_for_gloo_idle

                wait_for_gloo_idle()
        self.owns_group = False

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self.owns_group and self.distributed and self.backend == "gloo":
            # NOTE: a clean exit first lets gloo's worker thread finish with the last
            # collective. That thread releases a finished work's tensors under the GIL; if
            # the group's destructor runs first (destroy, or later the last DDP Reducer
            # holding the group) it joins the thread while holding the GIL, and torch 2.13
            # deadlocks (seen as a test rank stuck in ~ProcessGroupGloo after an
            # all_gather_object). A barrier carries no tensors and waits for the work before
            # it; it was not enough alone (its own work holds the ones before it until the
            # worker frees it), so `shutdown` also keeps the group (`_retire_groups`). The
            # barrier still keeps a rank from leaving while a peer is in the last
            # collective. Not after an exception: a peer may be gone, and the barrier would wait; a
            # peer that left through an exception closes its connections, which ends ours.
            with contextlib.suppress(RuntimeError):   # DistBackendError is a RuntimeError
                dist.barrier()
        elif exc_type is not None and self.owns_group and self.distributed:
            self._fail_together()
        self.shutdown()

    def _fail_together(self) -> None:
        """After an exception: count this rank as failed in the job's store, and where this
        process hosts that store (rank 0 under `--launcher env` or a script's own launch;
        torchrun's agent and `--launcher spawn`'s launcher host theirs), wait, at most
        `FAIL_TOGETHER_S`, for the other ranks to fail too before leaving.

        Why: a task that cannot be built fails on every rank, but not at the same moment.
        When rank 0 left first, its store went with it while rank 1 was still connecting
        its gloo pairs through it, and rank 1 printed torch's C++ store warnings with
        their native frames ("recvValue failed ... Connection reset by peer") above the
        one-line error (1 run in ~6 of a failing task under `--launcher spawn`). A rank
        that fails alone (the others wait in a collective) costs the bound and no more.
        """
        if self.world_size < 2 or not self.env.launched or envvars.uses_agent_store():
            return   # torchrun's agent hosts the store: it outlives every rank
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:   # leaving after a failure: never a second error
            return
        if self.rank != 0:
            # The store is rank 0's, maybe across a dead link or gone: counting in must
            # never hold this rank's exit, so it runs in a daemon thread given a moment.
            counting = threading.Thread(target=_count_failed, args=(store,), daemon=True,
                                        name="disttrain-fail-together")
            counting.start()
            counting.join(timeout=_COUNT_IN_S)
            return
        failed = _count_failed(store)   # this process's own store: local, at once
        deadline = time.monotonic() + FAIL_TOGETHER_S
        while failed < self.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            failed = _count_failed(store, 0)


def _count_failed(store: Any, n: int = 1) -> int:
    """Add `n` to the job's count of failed ranks; the count (0 when the store fails)."""
    try:
        return int(store.add(_FAILED_KEY, n))
    except Exception:   # leaving after a failure: never a second error
        return 0


# After an exception, how long the rank hosting the job's store waits for the other ranks to
# fail too (`Runtime._fail_together`), and the store key that counts them.
FAIL_TOGETHER_S = 5.0
_COUNT_IN_S = 1.0   # how long another rank gives its count before it leaves anyway
_FAILED_KEY = "disttrain/ranks_failed"

# Every process group this process destroyed: kept so that none is ever freed before the
# process ends (`_retire_groups`).
_RETIRED: list[Any] = []


def _retire_groups() -> None:
    """Keep a reference to every live group before `destroy_process_group`.

    Why: with torch 2.13, gloo's worker thread frees a finished work (and, through a
    barrier's work, the works before it) after the synchronous call has returned, and
    freeing a tensor that Python has already dropped needs the GIL. If the group's last
    reference goes in the meantime, `~ProcessGroupGloo` joins that thread while holding
    the GIL: a deadlock. Caught with py-spy on a test rank (torch._dynamo imported before
    the group, then DDP + all_gather_object, then the `with` block's end): the main thread
    in `Reducer::~Reducer -> ~ProcessGroupGloo -> std::thread::join`, the worker in
    `~AsyncBarrierWork -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject ->
    gil_scoped_acquire`. Whether destroy freed the group depended on import order (torch
    ._dynamo imported after the group holds it: worker.py's note); kept here, it never is
    before the process ends, in either order. A retired group's threads wait idle and its
    connections stay open until then: a handful per process at most (`setup` twice).
    """
    _RETIRED.extend(dist.distributed_c10d._world.pg_map)   # every group, the default one too


def _agent_store_restart() -> int | None:
    """torchrun's restart round when the workers share its agent's store, else None."""
    return envvars.restart_count() if envvars.uses_agent_store() else None


_groups_made = 0   # default groups this process has made on the agent's store


def _round_store(denv: DistEnv, restart: int, timeout: datetime.timedelta) -> Any:
    """The agent's store under a prefix of this restart round (and of this process's
    group, from its second on).

    torchrun's agent keeps one TCPStore across restarts (static rendezvous caches it)
    and init_process_group's keys (gloo addresses, the NCCL unique id) are the same in
    every round, so a restarted rank can read the dead round's value and fail with
    "Connection refused" (pytorch#135712, #167288). A prefix per round keeps them apart.
    The same holds within one round for a process that makes the default group again
    after destroying it (`setup` twice: a notebook, a sweep, two fits in one test spawn):
    torch names every new default group "0", so the second group's ranks could read the
    first's addresses; each group after the first gets its own prefix (the ranks make
    their groups in the same order, so their counts agree).
    """
    global _groups_made
    store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size,
                          is_master=False, timeout=timeout)
    prefix = f"disttrain/round_{restart}" + (f"/group_{_groups_made}" if _groups_made else "")
    _groups_made += 1
    return dist.PrefixStore(prefix, store)


def _bind_device(backend: str, denv: DistEnv) -> torch.device:
    """nccl: this rank's own GPU (cuda:LOCAL_RANK, made current); gloo: the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    if denv.local_rank >= torch.cuda.device_count():
        raise DistEnvError(f"LOCAL_RANK={denv.local_rank} but only "
                           f"{torch.cuda.device_count()} CUDA devices are visible")
    device = torch.device("cuda", denv.local_rank)
    torch.cuda.set_device(device)
    return device


def _init_group(backend: str, denv: DistEnv, device: torch.device, timeout_s: float,
                from_os_env: bool) -> None:
    """init_process_group for a launched rank, or a private one-rank group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not denv.launched:
        # One process: a private in-memory store, no port needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = device  # torch >= 2.3; older ones bind the device lazily
    # env:// under torchrun reuses the agent's TCPStore (no second port to bind);
    # an explicit env mapping (tests, the spawn launcher) gets a tcp:// store.
    restart = _agent_store_restart() if from_os_env else None
    if restart is not None:
        kwargs["store"] = _round_store(denv, restart, timeout)
    else:
        kwargs["init_method"] = ("env://" if from_os_env
                                 else f"tcp://{denv.master_addr}:{denv.master_port}")
    dist.init_process_group(backend, rank=denv.rank, world_size=denv.world_size,
                            timeout=timeout, **kwargs)


def setup(backend: str = "auto", timeout_s: float = 300.0, seed: int | None = None,
          env: Mapping[str, str] | None = None, threads: int | None = None) -> Runtime:
    """Create the process group from the launcher's env and bind this rank's device.

    Args:
        backend: "auto", "nccl" or "gloo".
        timeout_s: stall timeout; collectives time out after it plus a small grace
            (`collective_timeout_s`), so a rank stuck longer fails instead of
            hanging (torch's default is 30 minutes, far too long to notice a dead peer),
            and disttrain's launcher watchdog names the stuck rank first.
        seed: when given, seed all RNGs with it (the same on every rank, so models
            start identical; use `process.rank_seed` for per-rank data randomness).
        env: the environment to read (default os.environ).
        threads: torch intra-op threads; default: cores / local processes.

    Returns:
        A Runtime; use it as a context manager to destroy the group at the end.

    Raises:
        DistEnvError: the launcher's variables are malformed, nccl without GPUs, or a
            local rank without a GPU of its own.

    Example:
        >>> with setup("gloo") as rt:
        ...     rt.print0(rt.rank, rt.world_size)
    """
    denv = read_env(env)
    if denv.worker:
        set_rank_title(denv.rank, denv.world_size)  # ps/top tell the ranks apart (proctitle.py)
        own_session()    # scheduled as a torchrun worker is (process.own_session: why)
    tune_allocator()
    torch.set_num_threads(threads if threads is not None else threads_per_rank(denv.local_world_size))
    name = resolve_backend(backend, denv.local_world_size)
    device = _bind_device(name, denv)
    if seed is not None:
        seed_everything(seed)
    owns = False
    if dist.is_available() and not dist.is_initialized():
        _init_group(name, denv, device, collective_timeout_s(timeout_s), env is None)
        owns = True
    log.debug("rank %d/%d backend=%s device=%s", denv.rank, denv.world_size, name, device)
    return Runtime(denv, name, device, timeout_s, owns)


def setup_from_args(args: argparse.Namespace, timeout_s: float = 300.0, seed: int | None = None,
                    threads: int | None = None) -> Runtime:
    """`setup()` for a script parsed with `env.add_dist_args` (flags override the env)."""
    return setup(args.backend, timeout_s=timeout_s, seed=seed, env=env_from_args(args),
                 threads=threads)
