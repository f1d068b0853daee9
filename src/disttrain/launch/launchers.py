"""Start the workers of a job on this machine: torchrun (default), mp.spawn, or env.

    result = launch(spec)                            # LaunchResult(exit_code, failures, ...)
    result = launch_function(spec, fn, arg)          # result.values: {rank: fn(arg)}

Each launcher is a `Launcher`: `launch(plan) -> LaunchResult` (`disttrain.launch.result`),
for a `LaunchPlan` (`disttrain.launch.plan`: processes, master port, worker env).

Every launcher gives each worker the same environment contract, which
`disttrain.distributed.runtime` reads: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. OMP_NUM_THREADS is set to cores / local processes so ranks do
not fight over cores. The built-in job runs as a function that torchrun's elastic agent
*forks* from the warm fork server on CPU (no second torch import per worker, about 1 s
saved); user scripts run as `python script.py` subprocesses exactly as `torchrun
script.py` would, with rank-prefixed output and torchrun's exit status, through the
heartbeat entry (`python -m disttrain.resilience.script_heartbeat script.py`), which beats
the rank's heartbeat at each optimizer step (docs/resilience.md).

`python -m torch.distributed.launch` is deprecated in favour of torchrun and is not
offered: torchrun passes LOCAL_RANK in the environment instead of a `--local-rank`
argument, and adds elastic restarts.

While the launcher's stall watchdog runs, `envvars.WATCHDOG` is set to `launcher` in its
environment: a `python -m disttrain.worker` started under it then leaves the watching
to the launcher (without it, rank 0 would watch as it does under plain torchrun).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from disttrain import envvars
from disttrain.errors import Failure, FailureKind, LaunchError, PortTaken
from disttrain.launch.agent_logs import AGENT_LOG, agent_report_to, quiet_agent_stop, quiet_reported_failures
from disttrain.launch.agent_scratch import agent_scratch
from disttrain.launch.forkserver import worker_start_method
from disttrain.launch.plan import LaunchPlan, make_plan, start_error
from disttrain.launch.ports import free_port
from disttrain.launch.result import LaunchResult, RankFailure, peer_failures, typed_failures
from disttrain.launch.signals import signals_restored
from disttrain.launch.spawn import SpawnLauncher
from disttrain.rundir import clear_failures, read_failures
from disttrain.spec.job import JobSpec

# A port that was free when checked but taken when bound is picked again this often.
PORT_ATTEMPTS = 3


class Launcher(Protocol):
    """Starts the ranks of a planned job on this machine, waits for them, and says how
    they ended; worker failures are a result, never an exception."""

    def launch(self, plan: LaunchPlan) -> LaunchResult:
        """Run the job of `plan`.

        Raises:
            LaunchError: the ranks could not be started at all (PortTaken: the port was
                taken between choosing and binding it).
        """
        ...


# -- torch's elastic agent ----------------------------------------------------------------
@dataclass(frozen=True)
class ElasticLauncher:
    """`entry(*args)` on every local rank under torch's elastic agent (what torchrun runs).

    Attributes:
        entry: a picklable function (its return values become `values`), or an executable
            run as a subprocess with `args` as its arguments.
        args: the function's arguments, or the executable's argv.
        start_method: "forkserver" (forks of the warm server) or "spawn".
        logs_dir: where torch tees each rank's output (`plan.launch_config`); a failure's
            log text then includes those lines.
        agent_log: where torch's agent's own report of a failed worker goes instead of the
            terminal (`agent_logs.agent_report_to`); None: the terminal, as under torchrun.
    """

    entry: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    start_method: str = "spawn"
    logs_dir: Path | None = None
    agent_log: Path | None = None

    def launch(self, plan: LaunchPlan) -> LaunchResult:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        try:
            with agent_scratch() as scratch, signals_restored(), \
                    quiet_agent_stop(), agent_report_to(self.agent_log) as kept:
                config = plan.config(self.start_method, self.logs_dir, scratch)
                values = elastic_launch(config, self.entry)(*self.args)
        except ChildFailedError as exc:
            host = socket.gethostname()
            failures = {rank: RankFailure.from_elastic(f, host) for rank, f in exc.failures.items()}
            result = LaunchResult.failed(failures, log_text=_collect_logs(self.logs_dir, exc))
            if kept:   # said before `disttrain run`'s diagnosis, which comes last
                result.notes.append(f"torchrun's own report of the failure ({kept[0]} lines) "
                                    f"is in {self.agent_log}")
            return result
        except SignalException as exc:
            # The agent got SIGTERM / SIGINT, sent it to every worker and waited up to
            # launch.stop_grace_s for them (docs/resilience.md, "Graceful stop"); not a
            # failure, and never restarted under --max-restarts.
            return LaunchResult.stopped(int(exc.sigval))
        except KeyboardInterrupt:  # Ctrl-C before the agent took the signals over
            return LaunchResult.stopped(int(signal.SIGINT))
        return LaunchResult(values=dict(values or {}))


class TorchrunLauncher:
    """`--launcher torchrun` (the default): the built-in job forked from the warm fork
    server (torch and torch._dynamo imported, CUDA never initialised), or the user's
    script as a subprocess per rank with its output tee'd to `<run_dir>/logs`."""

    def launch(self, plan: LaunchPlan) -> LaunchResult:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        # torch < 2.2 has no DistError; plan.launch_config then names the torch it needs
        DistError = getattr(dist, "DistError", RuntimeError)

        spec = plan.spec
        if spec.script:
            # `python -u script.py args` with a heartbeat from its progress, so the
            # watchdog below covers an unmodified script too (docs/resilience.md), and
            # live files in the run dir (docs/monitoring.md)
            from disttrain.launch.argv import worker_command

            command = worker_command(spec, script_entry=True, live_dir=str(spec.run_dir))
            inner = ElasticLauncher(sys.executable, ("-u", *command), logs_dir=spec.run_dir / "logs",
                                    agent_log=spec.run_dir / "logs" / AGENT_LOG)
        else:
            from disttrain.worker import run_recorded, run_worker

            inner = ElasticLauncher(run_recorded, (run_worker, spec.model_dump()),
                                    start_method=worker_start_method(),
                                    agent_log=spec.run_dir / "logs" / AGENT_LOG)
        try:
            return inner.launch(plan)
        except (DistError, RendezvousError) as exc:  # the workers never started
            raise start_error(plan, exc) from None


def _collect_logs(logs_dir: Path | None, exc: Any) -> str:
    """Text for the doctor: tee'd worker logs (scripts) plus the failure records."""
    parts: list[str] = []
    if logs_dir is not None and logs_dir.is_dir():
        for path in sorted(logs_dir.rglob("*.log")):
            rank = path.parent.name
            with contextlib.suppress(OSError):
                parts += [f"[rank{rank}]:{line}" for line in
                          path.read_text(errors="replace").splitlines()]
    parts.append(exc.format_msg() if hasattr(exc, "format_msg") else str(exc))
    return "\n".join(parts)


# -- one rank from the environment -----------------------------------------------------------
class EnvLauncher:
    """`--launcher env`: one rank in this process from MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK.

    Every process of the job is started by hand (or by a scheduler) with the same
    MASTER_ADDR/MASTER_PORT/WORLD_SIZE and its own RANK; the port is used as given.
    A failure is printed with its traceback and reported as this rank's.
    """

    def launch(self, plan: LaunchPlan) -> LaunchResult:
        import traceback

        from disttrain.resilience.process_end import exit_status, flush_open_files

        spec = plan.spec
        rank = int(os.environ.get(envvars.RANK, "0") or 0)
        try:
            if spec.script:
                import runpy

                sys.argv = [spec.script, *spec.args]
                try:
                    runpy.run_path(spec.script, run_name="__main__")
                finally:   # this process ends without teardown (resilience.process_end)
                    flush_open_files()
            else:
                from disttrain.worker import run_worker

                run_worker(spec.model_dump())
        except SystemExit as exc:  # the script's own sys.exit(n), ended as python would
            code = exit_status(exc)
            if not code:
                return LaunchResult()
            return LaunchResult.failed({rank: RankFailure(exitcode=code)}, exit_code=code)
        except Exception as exc:
            text = traceback.format_exc()
            record = Failure.from_exception(exc, rank, os.getpid())   # typed here, where it is caught
            if not record.outcome.alone:  # else `disttrain run` says its message in one line
                print(text, file=sys.stderr, flush=True)
            failure = RankFailure(f"{type(exc).__name__}: {exc}").with_record(record)
            return LaunchResult.failed({rank: failure}, log_text=text)
        return LaunchResult()


LAUNCHERS: dict[str, Callable[[], Launcher]] = {
    "torchrun": TorchrunLauncher, "spawn": SpawnLauncher, "env": EnvLauncher}


# -- the entry points ----------------------------------------------------------------------
def plan_launch(spec: JobSpec) -> LaunchPlan:
    """The launch plan of `spec` (processes, the port): every check that can fail before a
    worker starts, so a caller can make it before it writes anything (docs/quickstart.md).

    Raises:
        LaunchError: an explicitly requested port is taken.
    """
    # env: every invocation must use the same given port
    return make_plan(spec, pick_port=spec.launch.launcher != "env")


def launch(spec: JobSpec, plan: LaunchPlan | None = None) -> LaunchResult:
    """Run `spec` on this machine with its launcher; never raises for worker failures.

    Args:
        spec: the job.
        plan: `plan_launch(spec)`, when the caller made it first (to check the port and
            print its notes before writing the run directory); made here otherwise.

    Raises:
        LaunchError: the ranks cannot be started (an explicitly requested port is taken,
            no rendezvous, `--launcher spawn` with a script).
    """
    # a caller's plan: its notes are the caller's to print; result.notes has only the new ones
    said = 0 if plan is None else len(plan.notes)
    plan = plan or plan_launch(spec)
    for k, v in plan.env.items():
        os.environ.setdefault(k, v)
    launcher = LAUNCHERS[spec.launch.launcher]()
    fixed_port = spec.launch.port_explicit and spec.launch.master_port != 0
    own_records = spec.launch.launcher != "env"   # env: each rank its own launch, typed in-process
    if own_records:
        clear_failures(spec.run_dir)
    for attempt in range(PORT_ATTEMPTS):
        try:
            with _watchdog(plan.spec, plan.nproc) as wd, quiet_reported_failures(spec.run_dir):
                result = launcher.launch(plan)
            break
        except PortTaken as exc:
            # Free when checked, taken when bound (another job started in between): a
            # port nobody asked for is picked again; an explicit one is an error.
            if fixed_port or attempt == PORT_ATTEMPTS - 1:
                raise LaunchError(str(exc)) from None
            old, port = plan.spec.launch.master_port, free_port()
            plan = plan.moved_to(port, f"port {old} was taken just before the start; "
                                       f"using free port {port}")
    result.notes[:0] = plan.notes[said:]
    if own_records and result.failures:   # what each failed rank recorded: its failure's kind
        records = read_failures(spec.run_dir)
        result.failures = typed_failures(result.failures, records)
        if spec.launch.max_restarts == 0:   # one round: every record is this round's
            result.failures.update(peer_failures(result.failures, records))
    if wd is not None:
        _add_stalls(result, wd.stalls)
    return result


def launch_function(spec: JobSpec, entry: Callable[..., Any], *args: Any) -> LaunchResult:
    """Run `entry(*args)` on the spec's ranks with torch's elastic launcher.

    The same launch as `disttrain run` (`plan.launch_config`: static rendezvous on one
    node, c10d on several, the port moved when taken, workers forked from the warm fork
    server), for a function instead of the training job: what `disttrain verify` and
    the benchmarks run. Each rank runs it under torch's @record (`worker.run_recorded`),
    so a crash's traceback names the rank. The process environment is restored
    afterwards (the elastic agent writes TORCHELASTIC_* into it).

    Args:
        spec: the job's launch settings (nproc, nodes, port, backend, timeout).
        entry: a picklable function; each rank returns its value.
        *args: passed to `entry` on every rank.

    Returns:
        The values by global rank (`values`), or the failed ranks and why (`failures`).

    Raises:
        LaunchError: an explicitly requested port is taken.

    Example:
        >>> result = launch_function(spec, verify.runner.worker, opts)
    """
    from disttrain.worker import run_recorded

    plan = make_plan(spec)
    saved = dict(os.environ)
    try:
        for name, value in plan.env.items():
            envvars.set_env(name, value)
        launcher = ElasticLauncher(run_recorded, (entry, *args), start_method=worker_start_method())
        result = launcher.launch(plan)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result.notes[:0] = plan.notes
    if result.signal and not result.failures:  # SIGTERM / Ctrl-C: no values; say why, as a failure
        name = signal.Signals(result.signal).name
        result.failures = {0: RankFailure(f"stopped by {name}", exitcode=result.exit_code,
                                          kind=FailureKind.INTERRUPTED)}
    return result


# -- the launcher's stall watchdog -----------------------------------------------------------
@contextlib.contextmanager
def _watchdog(spec: JobSpec, nproc: int) -> Iterator[Any]:
    """Watch the ranks' heartbeats in the job's store while the launcher runs.

    A rank without progress for launch.timeout_s is reported on stderr at once and
    SIGKILLed; torchrun then fails the job or, with --max-restarts, restarts it. The
    `env` launcher runs one rank in this very process: nothing to watch from outside.
    """
    launch = spec.launch
    if launch.launcher == "env":
        yield None
        return
    from disttrain.resilience.watchdog import Stall, Watchdog, stall_line

    host, port = launch.master_addr, launch.master_port
    if launch.nnodes > 1 and launch.launcher == "torchrun" and launch.rdzv_endpoint:
        host, _, port_text = launch.rdzv_endpoint.rpartition(":")
        port = int(port_text) if port_text.isdigit() else port

    def report(stall: Stall) -> None:
        print(stall_line(stall), file=sys.stderr, flush=True)

    # Workers that run `python -m disttrain.worker` (a script may) inherit the mark, so
    # rank 0 does not watch as well: one report per stall.
    with envvars.set_while(envvars.WATCHDOG, "launcher"), \
            Watchdog(host, port, world_size=launch.nnodes * nproc, timeout_s=launch.timeout_s,
                     on_stall=report) as wd:
        yield wd


def _add_stalls(result: LaunchResult, stalls: Sequence[Any]) -> None:
    """Fold the watchdog's findings into `result`: they name the cause, so they lead the
    log text; a failed job's stalled ranks failed too (the watchdog killed them), with the
    kind the watchdog saw (`Stall.kind`: a stall, or a lost host)."""
    if not stalls:
        return
    result.stalls = [s.message for s in stalls]
    result.log_text = "\n".join(f"error: {m}" for m in result.stalls) + "\n" + result.log_text
    if result.exit_code != 0:
        for stall in stalls:
            for rank, pid in ((stall.rank, stall.pid), *stall.tied):
                known = result.failures.get(rank)   # torch's record of the kill: the stall is why
                result.failures[rank] = RankFailure(
                    stall.message, exitcode=-9, host=stall.host, pid=pid, kind=stall.kind
                ) if known is None else replace(known, kind=stall.kind)
