"""Start the workers of a job on this machine: torchrun (default), mp.spawn, or env.

    result = launch(spec)                            # LaunchResult(exit_code, failures, ...)
    outcome = launch_function(spec, entry, arg)      # {rank: entry(arg)} or failures

Every launcher gives each worker the same environment contract (seed 000 §2.2), which
`disttrain.distributed.runtime` reads: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT. OMP_NUM_THREADS is set to cores / local processes so ranks do not fight
over cores. The built-in job runs as a function that torchrun's elastic agent *forks*
on CPU (no second torch import per worker, about 1 s saved); user scripts run as
`python script.py` subprocesses exactly as `torchrun script.py` would, with
rank-prefixed output and torchrun's exit status.

`python -m torch.distributed.launch` (seed 000 §5.2 way 2) is deprecated in favour of
torchrun and is not offered: torchrun passes LOCAL_RANK in the environment instead of a
`--local-rank` argument, and adds elastic restarts.

While the launcher's stall watchdog runs, DISTTRAIN_WATCHDOG=launcher is set in its
environment: a `python -m disttrain.worker` started under it then leaves the watching
to the launcher (without it, rank 0 would watch as it does under plain torchrun).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.errors import LaunchError, PortTaken
from disttrain.launch.argv import resolve_nproc
from disttrain.spec.job import JobSpec


@dataclass
class LaunchOutcome:
    """`launch_function`'s result: return values by global rank, or the failed ranks
    with their message."""

    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class LaunchResult:
    exit_code: int
    failures: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    log_text: str = ""
    stalls: list[str] = field(default_factory=list)  # the watchdog's reports (issue 7)


# -- ports (seed 000 §8.3) ---------------------------------------------------------------
from disttrain.launch.ports import port_free  # noqa: E402 - re-exported for callers of launch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def choose_port(spec: JobSpec) -> tuple[int, str | None]:
    """The master port to use and, when it moved, a note saying so.

    Raises:
        LaunchError: an explicitly requested port is taken.
    """
    launch = spec.launch
    local = launch.nnodes == 1 and launch.master_addr in ("127.0.0.1", "localhost")
    if not local:
        return launch.master_port, None
    host = "127.0.0.1"
    if launch.master_port == 0:
        return free_port(host), None
    if port_free(launch.master_port, host):
        return launch.master_port, None
    if launch.port_explicit:
        raise LaunchError(
            f"master port {launch.master_port} is already in use (Address already in use); "
            f"stop the process holding it (`ss -ltnp | grep {launch.master_port}`) or pass "
            f"another --master-port (0 picks a free one)")
    port = free_port(host)
    return port, f"port {launch.master_port} is in use; using free port {port} instead"


def worker_env(spec: JobSpec, nproc: int) -> dict[str, str]:
    """Variables every local worker inherits (threads per rank, start-up clock)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = spec.train.threads or max(1, (cores or 1) // nproc)
    env = {"OMP_NUM_THREADS": str(threads)}
    env.setdefault("DISTTRAIN_T0", os.environ.get("DISTTRAIN_T0") or str(_process_start()))
    return env


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()


# The built-in job's dataset, for the warm fork server to load (`disttrain.launch.forkserver_preload`).
WARM_DATASET_ENV = "DISTTRAIN_WARM_DATASET"


def prewarm_workers(dataset: dict[str, Any] | None = None) -> bool:
    """Start the warm fork server for built-in-job workers (see `disttrain.launch.forkserver_preload`).

    Call before importing torch in the launcher, so both imports overlap. Returns False
    where fork servers do not exist (non-POSIX).

    Args:
        dataset: keyword arguments of `disttrain.train.data.warm_dataset` (the built-in job's
            data), for the server to load once for all its forks; only the call that
            starts the server passes them on.
    """
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.set_forkserver_preload(["disttrain.launch.forkserver_preload"])
    if dataset is not None:  # the server inherits this environment when it starts
        os.environ[WARM_DATASET_ENV] = json.dumps(dataset)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(WARM_DATASET_ENV, None)
    return True


# -- launchers -----------------------------------------------------------------------
def launch(spec: JobSpec, spec_path: Path | None = None) -> LaunchResult:
    """Run `spec` on this machine with its launcher; never raises for worker failures."""
    nproc = resolve_nproc(spec)
    note = None
    fixed_port = spec.launch.port_explicit and spec.launch.master_port != 0
    if spec.launch.launcher != "env":  # env: every invocation must use the same given port
        port, note = choose_port(spec)
        spec = spec.model_copy(
            update={"launch": spec.launch.model_copy(update={"master_port": port})})
    for k, v in worker_env(spec, nproc).items():
        os.environ.setdefault(k, v)
    notes = [note] if note else []
    for attempt in range(3):
        try:
            with _watchdog(spec, nproc) as wd:
                if spec.launch.launcher == "spawn":
                    result = _launch_spawn(spec, nproc)
                elif spec.launch.launcher == "env":
                    result = _launch_env(spec)
                else:
                    result = _launch_torchrun(spec, nproc, spec_path)
            break
        except PortTaken as exc:
            # Free when checked, taken when bound (another job started in between): a
            # port nobody asked for is picked again; an explicit one is an error.
            if fixed_port or attempt == 2:
                raise LaunchError(str(exc)) from None
            old, port = spec.launch.master_port, free_port()
            notes.append(f"port {old} was taken just before the start; using free port {port}")
            spec = spec.model_copy(
                update={"launch": spec.launch.model_copy(update={"master_port": port})})
    result.notes[:0] = notes
    if wd is not None and wd.stalls:
        result.stalls = [s.message for s in wd.stalls]
        result.log_text = "\n".join(f"error: {m}" for m in result.stalls) + "\n" + result.log_text
        if result.exit_code != 0:  # the stalled ranks failed too: the watchdog killed them
            for stall in wd.stalls:
                for rank, pid in ((stall.rank, stall.pid), *stall.tied):
                    result.failures.setdefault(rank, {
                        "exitcode": -9, "message": stall.message, "host": stall.host,
                        "pid": pid, "stalled": True})
    return result


@contextlib.contextmanager
def _watchdog(spec: JobSpec, nproc: int) -> Iterator[Any]:
    """Watch the ranks' heartbeats in the job's store while the launcher runs (issue 7).

    A rank without progress for launch.timeout_s is reported on stderr at once and
    SIGKILLed; torchrun then fails the job or, with --max-restarts, restarts it. The
    `env` launcher runs one rank in this very process: nothing to watch from outside.
    """
    launch = spec.launch
    if launch.launcher == "env":
        yield None
        return
    from disttrain.resilience.watchdog import ENV_WATCHDOG, Stall, Watchdog, stall_line

    host, port = launch.master_addr, launch.master_port
    if launch.nnodes > 1 and launch.launcher == "torchrun" and launch.rdzv_endpoint:
        host, _, port_text = launch.rdzv_endpoint.rpartition(":")
        port = int(port_text) if port_text.isdigit() else port

    def report(stall: Stall) -> None:
        print(stall_line(stall), file=sys.stderr, flush=True)

    # Workers that run `python -m disttrain.worker` (a script may) inherit the mark, so
    # rank 0 does not watch as well: one report per stall.
    saved = os.environ.get(ENV_WATCHDOG)
    os.environ[ENV_WATCHDOG] = "launcher"
    try:
        with Watchdog(host, port, world_size=launch.nnodes * nproc,
                      timeout_s=launch.timeout_s, on_stall=report) as wd:
            yield wd
    finally:
        if saved is None:
            os.environ.pop(ENV_WATCHDOG, None)
        else:
            os.environ[ENV_WATCHDOG] = saved


def _launch_config(spec: JobSpec, nproc: int, logs_dir: Path | None, start_method: str) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    launch = spec.launch
    if launch.nnodes == 1:
        rdzv_backend, endpoint = "static", f"{launch.master_addr}:{launch.master_port}"
        configs: dict[str, Any] = {"rank": 0, "timeout": int(launch.timeout_s)}
    else:
        rdzv_backend = "c10d"
        endpoint = launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}"
        configs = {"timeout": int(launch.timeout_s)}
    logs_specs = None
    if logs_dir is not None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        logs_specs = DefaultLogsSpecs(log_dir=str(logs_dir), redirects=Std.NONE, tee=Std.ALL)
    return LaunchConfig(
        min_nodes=launch.nnodes, max_nodes=launch.nnodes, nproc_per_node=nproc,
        run_id=launch.rdzv_id or f"{spec.name}-{uuid.uuid4().hex[:8]}",
        rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=configs,
        max_restarts=launch.max_restarts, monitor_interval=0.05,
        start_method=start_method, logs_specs=logs_specs,
        log_line_prefix_template="[rank${rank}]:" if logs_dir is not None else None,
    )


def _launch_torchrun(spec: JobSpec, nproc: int, spec_path: Path | None) -> LaunchResult:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if spec.script:
        logs_dir = spec.run_dir / "logs"
        config = _launch_config(spec, nproc, logs_dir, "spawn")
        entry: Any = sys.executable
        args: tuple[Any, ...] = ("-u", spec.script, *spec.args)
    else:
        # Workers are forks of the warm fork server (prewarm_workers), which has torch
        # and torch._dynamo imported and has never initialised CUDA.
        method = "forkserver" if prewarm_workers() else "spawn"
        config = _launch_config(spec, nproc, None, method)
        from disttrain.worker import elastic_entry

        entry, args = elastic_entry, (spec.model_dump(),)
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        elastic_launch(config, entry)(*args)
    except (DistError, RendezvousError) as exc:  # the workers never started
        endpoint = config.rdzv_endpoint
        text = str(exc).lower()
        if spec.launch.nnodes == 1 and ("address already in use" in text or "eaddrinuse" in text):
            raise PortTaken(f"master port {spec.launch.master_port} is already in use (Address "
                            f"already in use); pass another --master-port (0 picks a free "
                            f"one)") from None
        raise LaunchError(
            f"cannot rendezvous at {endpoint} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); check --master-addr/--master-port (or "
            f"--rdzv-endpoint), that node 0 is up, and --timeout-s") from None
    except ChildFailedError as exc:
        failures = {rank: {"exitcode": f.exitcode, "message": f.message,
                           "host": socket.gethostname(), "local_rank": f.local_rank,
                           "error_file": f.error_file}
                    for rank, f in exc.failures.items()}
        return LaunchResult(1, failures, log_text=_collect_logs(spec, exc))
    return LaunchResult(0)


def launch_function(spec: JobSpec, entry: Callable[..., Any], *args: Any) -> LaunchOutcome:
    """Run `entry(*args)` on the spec's ranks with torch's elastic launcher.

    The same launch as `disttrain run` (`_launch_config`: static rendezvous on one node,
    c10d on several, the port moved when taken, workers forked from the warm fork
    server), for a function instead of the training job: what `disttrain verify` and
    the benchmarks run. The process environment is restored afterwards (the elastic
    agent writes TORCHELASTIC_* into it).

    Args:
        spec: the job's launch settings (nproc, nodes, port, backend, timeout).
        entry: a picklable function; each rank returns its value.
        *args: passed to `entry` on every rank.

    Returns:
        The values by global rank, or the failed ranks and why.

    Raises:
        LaunchError: an explicitly requested port is taken.

    Example:
        >>> outcome = launch_function(spec, verify.elastic_entry, opts)
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    nproc = resolve_nproc(spec)
    port, note = choose_port(spec)
    spec = spec.model_copy(update={"launch": spec.launch.model_copy(update={"master_port": port})})
    saved = dict(os.environ)
    outcome = LaunchOutcome(notes=[note] if note else [])
    try:
        os.environ.update(worker_env(spec, nproc))
        method = "forkserver" if prewarm_workers() else "spawn"
        config = _launch_config(spec, nproc, None, method)
        try:
            outcome.values = dict(elastic_launch(config, entry)(*args))
        except ChildFailedError as exc:
            outcome.failures = {rank: _failure_text(f) for rank, f in exc.failures.items()}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return outcome


def _failure_text(failure: Any) -> str:
    """One line per failed rank: its exit code and the last line of its error."""
    message = str(getattr(failure, "message", "") or "")
    if isinstance(getattr(failure, "message", None), dict):
        message = str(failure.message.get("message", ""))
    first = message.strip().splitlines()[-1] if message.strip() else ""
    if "To enable traceback" in first:  # torch's placeholder when no error file was written
        first = ""
    return f"rank crashed (exit code {failure.exitcode}){': ' + first if first else ''}"


def _collect_logs(spec: JobSpec, exc: Any) -> str:
    """Text for the doctor: tee'd worker logs (scripts) plus the failure records."""
    parts: list[str] = []
    logs = spec.run_dir / "logs"
    if spec.script and logs.is_dir():
        for path in sorted(logs.rglob("*.log")):
            rank = path.parent.name
            with contextlib.suppress(OSError):
                parts += [f"[rank{rank}]:{line}" for line in
                          path.read_text(errors="replace").splitlines()]
    parts.append(exc.format_msg() if hasattr(exc, "format_msg") else str(exc))
    return "\n".join(parts)


def _spawn_entry(local_rank: int, spec_data: dict[str, Any], nproc: int) -> None:
    """mp.spawn target (seed 002): set the env contract for this rank, then run it."""
    launch = spec_data["launch"]
    os.environ.update({
        "RANK": str(launch["node_rank"] * nproc + local_rank),
        "WORLD_SIZE": str(launch["nnodes"] * nproc), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": launch["master_addr"],
        "MASTER_PORT": str(launch["master_port"]),
    })
    from disttrain.worker import run_worker

    run_worker(spec_data)


def _launch_spawn(spec: JobSpec, nproc: int) -> LaunchResult:
    """`--launcher spawn` (seed 002's mp.spawn): torch.multiprocessing's start_processes,
    which mp.spawn is, with the workers forked from the warm fork server where there is
    one (the start method is the only difference: no torch import per worker)."""
    if spec.script:
        raise LaunchError("--launcher spawn runs the built-in job; run a script with torchrun "
                          "(the default) or call mp.spawn inside it")
    import torch.multiprocessing as mp

    method = "forkserver" if prewarm_workers() else "spawn"
    first = spec.launch.node_rank * nproc
    try:
        mp.start_processes(_spawn_entry, args=(spec.model_dump(), nproc), nprocs=nproc,
                           join=True, start_method=method)
    except mp.ProcessRaisedException as exc:
        return LaunchResult(1, {first + exc.error_index: {"message": str(exc)}},
                            log_text=str(exc))
    except mp.ProcessExitedException as exc:
        return LaunchResult(1, {first + exc.error_index: {"exitcode": exc.exit_code,
                                                          "message": str(exc)}}, log_text=str(exc))
    return LaunchResult(0)


def _launch_env(spec: JobSpec) -> LaunchResult:
    """One rank in this process from MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK (§5.2 way 3).

    Every process of the job is started by hand (or by a scheduler) with the same
    MASTER_ADDR/MASTER_PORT/WORLD_SIZE and its own RANK; the port is used as given.
    A failure is printed with its traceback and reported as this rank's.
    """
    import traceback

    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        if spec.script:
            import runpy

            sys.argv = [spec.script, *spec.args]
            runpy.run_path(spec.script, run_name="__main__")
        else:
            from disttrain.worker import run_worker

            run_worker(spec.model_dump())
    except SystemExit as exc:  # the script's own sys.exit(n)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return LaunchResult(code, {rank: {"exitcode": code}} if code else {})
    except Exception as exc:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        return LaunchResult(1, {rank: {"message": f"{type(exc).__name__}: {exc}"}}, log_text=text)
    return LaunchResult(0)
