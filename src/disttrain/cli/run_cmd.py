"""`disttrain run`: the main job, a spec file, or a user script, on this machine.

    disttrain run                                   # SimpleNet on digits, DDP, 2 processes
    disttrain run --example chargpt                 # = --task disttrain.examples.chargpt:make_task
    disttrain run -f job.yaml --epochs 3
    disttrain run --task mytask:make_task --task-args '{hidden: 256}'   # your TrainTask
    disttrain run train.py --nproc-per-node 2 -- --lr 0.01    # runs/train/run-N, every attempt kept
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import click

from disttrain.cli.options import SpecCommand, SpecFile, fail, job_overrides, load_spec, spec_options


@click.command(cls=SpecCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("-f", "--file", "spec_file", type=SpecFile(),
              help="job spec YAML; flags override its fields")
@click.option("--dry-run", is_flag=True, help="print the resolved spec and torchrun command")
@spec_options([None, "launch", "train"])
def run(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
        dry_run: bool, **kwargs: Any) -> None:
    """Train the built-in job (default: SimpleNet on digits, DDP over 2 processes),
    your TrainTask (--task module:function), the job in a spec file, or SCRIPT under
    torchrun: SCRIPT takes the launch options, and its own arguments after `--`."""
    overrides = job_overrides(script, script_args, kwargs)
    spec = load_spec(spec_file, overrides)
    if not dry_run:
        _prewarm(spec)
    if "master_port" in overrides or _file_sets_port(spec_file):
        spec.launch.port_explicit = True
    try:
        _check_inputs(spec)
    except click.exceptions.Exit:
        _stop_prewarmed()   # refused: the warm server would import torch._dynamo for nothing
        raise
    if spec.script:
        _script_defaults(spec)
    if dry_run:
        from disttrain.launch.argv import torchrun_argv

        click.echo(spec.to_yaml() + "---\n" + " ".join(
            torchrun_argv(spec, spec_path=str(spec.run_dir / "job.yaml"), script_entry=True)))
        return
    raise click.exceptions.Exit(_run(spec))


def _script_defaults(spec: Any) -> None:
    """A script's own run dir, so that runs of `a.py` and `b.py` never share (and never
    delete) each other's logs (the spec names the job after the script's stem): each
    attempt its own folder `<run dir>/run-N` (default run dir `runs/<script stem>`;
    docs/your-model.md). Under `--launcher env` every rank is its own `disttrain run`, so
    the run dir is used as it is (no attempt folder per rank)."""
    from disttrain.rundir import next_attempt_dir

    stem = Path(spec.script).stem or "script"
    base = Path(spec.train.run_dir or f"runs/{stem}")
    spec.train.run_dir = str(base if spec.launch.launcher == "env" else next_attempt_dir(base))


def _prewarm(spec: Any) -> None:
    """Start the workers' warm fork server now, as a fork of this process right after its
    torch import (`disttrain.launch.forkserver`, share_torch), and let it load a built-in
    task's data once for all local workers (`disttrain.launch.forkserver_preload`)."""
    if spec.launch.launcher != "torchrun" or spec.script:
        return
    import os

    from disttrain.launch.argv import resolve_nproc
    from disttrain.launch.forkserver import prewarm_workers
    from disttrain.launch.plan import worker_env
    from disttrain.plan.mesh_fit import MODEL_CHECK_IMPORTS, builds_model

    # What the workers will inherit (OMP_NUM_THREADS), without asking torch how many GPUs
    # there are (gpus=0): that import is what the server overlaps.
    nproc = resolve_nproc(spec, gpus=0)
    for k, v in worker_env(spec, nproc).items():
        os.environ.setdefault(k, v)

    # A built-in task's warm hook loads its data once in the server (train/task.py). Only
    # disttrain's own tasks: the server must never touch CUDA (its forks could not use a GPU
    # then), which disttrain's modules keep to and a user's module need not.
    own = spec.task.startswith("disttrain.")
    # a tp / pp job's model check (_check_inputs) imports torch._dynamo and DTensor here
    # anyway: imported before the fork, the server and its workers share them
    shared = MODEL_CHECK_IMPORTS if builds_model(spec, nproc) else ()
    prewarm_workers({"ref": spec.task, "args": spec.task_args} if own else None,
                    share_torch=True, share_imports=shared)


def _stop_prewarmed() -> None:
    from disttrain.launch.forkserver import stop_prewarmed

    stop_prewarmed()


def _file_sets_port(spec_file: str | None) -> bool:
    if not spec_file:
        return False
    import yaml

    data = yaml.safe_load(Path(spec_file).read_text()) or {}
    return isinstance(data.get("launch"), dict) and "master_port" in data["launch"]


def _check_inputs(spec: Any) -> None:
    """Refuse, before any process starts, what would only fail inside every worker: the
    host rules (`disttrain.spec.rules.check_runnable`, which every rank applies again),
    a script that cannot be read, a task that cannot be built with its arguments (its
    check: e.g. missing MNIST files), parallelism degrees its model cannot be split into."""
    from disttrain.errors import DistEnvError, DisttrainError
    from disttrain.launch.devices import local_gpu_count
    from disttrain.spec.paths import check_readable_file
    from disttrain.spec.rules import check_runnable

    try:
        if spec.script:
            check_readable_file(spec.script, "script ", kind="script")
            _check_own_workers(spec)
        if spec.task:
            _check_task(spec)
            from disttrain.plan.mesh_fit import check_mesh_fits  # imports torch: tasks only

            # the degrees' product, tp divides the heads, pp <= the blocks (meta model)
            check_mesh_fits(spec, _local_nproc(spec))
        check_runnable(spec, gpus=local_gpu_count(), world_size=_env_world_size(spec))
    except DistEnvError as exc:
        fail(f"--launcher env: {exc}")
    except DisttrainError as exc:
        fail(str(exc))


def _check_own_workers(spec: Any) -> None:
    """A script that starts its own workers (mp.spawn) must not be started once per rank:
    with several processes per node each would start its own set, and they would fight
    over the script's port and hang (`disttrain.launch.own_workers`). It runs as one
    process (`nproc_per_node: auto` becomes 1), with plain python's environment and its
    workers watched (`disttrain.resilience.spawned`)."""
    from disttrain.launch.argv import resolve_nproc
    from disttrain.launch.own_workers import own_workers

    if spec.launch.launcher != "torchrun" or spec.launch.nnodes != 1:
        return
    found = own_workers(spec.script)
    if not found:
        return
    where = ", ".join(f"{w.call} at line {w.line}" for w in found[:3])
    if spec.launch.nproc_per_node == "auto":
        spec.launch.nproc_per_node = 1
        click.echo(f"note: {spec.script} starts its own workers ({where}): running it as one "
                   f"process, as `python {spec.script}` would, with its workers watched", err=True)
        return
    nproc = resolve_nproc(spec)
    if nproc > 1:
        fail(f"script {spec.script} starts its own worker processes ({where}): with "
             f"{nproc} processes per node each copy would start its own and they would "
             f"fight over its port; run it with --nproc-per-node 1 (or leave the flag out): "
             f"disttrain then starts it once, as `python {spec.script}` would, and watches "
             f"the workers it spawns")


def _check_task(spec: Any) -> None:
    """Import the task's module, validate `task_args` against its function's signature and
    run its check, as the workers will (the same search path as `build_trainer`), without
    calling it: a reference that does not resolve exits 2 before the run dir is touched."""
    import os

    from disttrain.train.task import check_task

    check_task(spec.task, spec.task_args, search=[spec.task_dir or ".", os.getcwd()])


def _local_nproc(spec: Any) -> int | None:
    """The processes the launcher will start here (`auto` resolved as `launch.plan.make_plan`
    does); None under `--launcher env` (WORLD_SIZE sizes that job, read in each rank)."""
    from disttrain.launch.argv import resolve_nproc

    return resolve_nproc(spec) if spec.launch.launcher != "env" else None


def _env_world_size(spec: Any) -> int | None:
    """WORLD_SIZE under `--launcher env` with strategy dp (each rank is its own `disttrain
    run`, so the environment is all there is to know the job's size); None otherwise."""
    if spec.script or spec.train.strategy != "dp" or spec.launch.launcher != "env":
        return None
    from disttrain.distributed.env import read_env

    return read_env().world_size


def _prepare_run_dir(spec: Any) -> Path:
    """Create the run dir (clearing an earlier run's outputs) and write job.yaml there
    (`disttrain.rundir.prepare_run_dir`); only the rank that owns the outputs may delete
    them (see `_owns_outputs`)."""
    from disttrain.errors import SpecError
    from disttrain.rundir import prepare_run_dir
    from disttrain.spec.paths import check_writable_dir

    try:
        check_writable_dir(spec.run_dir, "train.run_dir: ")
    except SpecError as exc:
        fail(str(exc))
    if spec.script:  # nothing of an earlier attempt is deleted (`_script_defaults`)
        path = prepare_run_dir(spec.run_dir, spec.to_yaml(), clear=False, note=click.echo)
        if spec.launch.launcher != "env":
            from disttrain.rundir import mark_latest

            mark_latest(spec.run_dir)
            click.echo(f"note: this run's logs go to {spec.run_dir}/logs "
                       f"({spec.run_dir.parent}/latest points to it); watch it with "
                       f"`disttrain top {spec.run_dir}`", err=True)
        return path
    clear = not spec.train.resume and spec.run_dir.exists() and _owns_outputs(spec)
    return prepare_run_dir(spec.run_dir, spec.to_yaml(), clear=clear, note=click.echo)


def _owns_outputs(spec: Any) -> bool:
    """Whether this invocation may clear the run dir: always, except under `--launcher env`.

    With `env` every rank is its own `disttrain run` and they may share a run dir; a
    rank other than 0 that starts a moment later would delete rank 0's fresh outputs.
    """
    if spec.launch.launcher != "env":
        return True
    from disttrain.distributed.env import read_env
    from disttrain.errors import DistEnvError

    try:
        return read_env().rank == 0
    except DistEnvError as exc:
        fail(f"--launcher env: {exc}")


def _run(spec: Any) -> int:
    from disttrain.errors import LaunchError
    from disttrain.launch.launchers import launch, plan_launch
    from disttrain.resilience.preemption import clear_stop_record, stop_failure

    # The port is checked (and a free one chosen) before the run dir is touched: a job
    # that cannot start must not have wiped the previous run's outputs; its notes are
    # said now, before the workers' output.
    try:
        plan = plan_launch(spec)
    except LaunchError as exc:
        _stop_prewarmed()
        fail(str(exc))
    for note in plan.notes:
        click.echo(f"note: {note}", err=True)
    _prepare_run_dir(spec)
    clear_stop_record(spec.run_dir)
    started = time.time()
    try:
        result = launch(spec, plan)
    except LaunchError as exc:
        fail(str(exc))
    if spec.script and spec.launch.launcher == "torchrun":
        _finish_script(spec, result.exit_code, time.time() - started)
    for note in result.notes:   # e.g. the port moved because it was taken at bind time
        click.echo(f"note: {note}", err=True)
    # SIGTERM / SIGINT (preemption, Ctrl-C): a typed stop (disttrain.resilience.preemption),
    # said in one line with its kind's exit status: EXIT_STOPPED when the ranks stopped
    # cleanly with a checkpoint
    stopped = stop_failure(spec.run_dir, result.signal, bool(spec.script), _resume_command(),
                           since=started)
    if stopped is not None:
        return _say_alone(stopped, result.exit_code)
    if result.exit_code != 0:
        return _report_failure(result)
    return result.exit_code


def _finish_script(spec: Any, exit_code: int, wall_s: float) -> None:
    """A script's ranks wrote live files (`monitor.script_live`): their rows become the run
    dir's metrics.jsonl and summary.json, so `disttrain report` reads a script's run too."""
    from disttrain.monitor.script_live import finish_script_run

    with contextlib.suppress(OSError):
        finish_script_run(spec.run_dir, exit_code, wall_s)


def _resume_command() -> str:
    """This very command with `--resume` (before a script's `--`), to continue a stopped run."""
    import shlex
    import sys

    args = list(sys.argv[1:])
    if "--resume" not in args:
        args.insert(args.index("--") if "--" in args else len(args), "--resume")
    return shlex.join(["disttrain", *args])


def _report_failure(result: Any) -> int:
    """Say why the job failed and return the exit status, by the kind of the first rank that
    really failed (typed where it was detected: `errors.OUTCOMES` is the one table); a
    rank's own kind (a task error, a stall, a lost host...) before another's crash, which
    is what a rank whose collective broke when that one left records. A kind whose message
    says it all (the user's task: exit 2; a checkpoint not written: exit 1) is said once,
    from that rank's record; any other gets the failed ranks and the diagnosis of the logs
    (a stall's line leads it)."""
    from disttrain.errors import OUTCOMES, FailureKind

    # a rank torchrun stopped counts when it had recorded a failure of its own before
    failed = [f for _, f in sorted(result.failures.items())
              if not _stopped(f) or f.kind is not FailureKind.CRASH]
    first = next((f for f in failed if f.kind is not FailureKind.CRASH), failed[0] if failed else None)
    outcome = OUTCOMES[first.kind if first is not None else FailureKind.CRASH]
    if first is not None and first.record is not None and outcome.alone:
        return _say_alone(first.record, result.exit_code)
    _explain_failure(result)
    return result.exit_code if outcome.exit_code is None else outcome.exit_code


def _say_alone(failure: Any, job_exit_code: int) -> int:
    """Say a failure whose message says it all (`errors.Failure`) in its kind's one line
    and return its kind's exit status (`errors.OUTCOMES`; the job's own where it has none)."""
    outcome = failure.outcome
    click.echo(outcome.line(failure.message), err=True)
    return job_exit_code if outcome.exit_code is None else outcome.exit_code


def _stopped(failure: Any) -> bool:
    """A rank torchrun stopped (SIGTERM) because another failed."""
    return getattr(failure, "exitcode", None) == -15


def _failed_ranks(failures: dict[int, Any]) -> list[int]:
    """Ranks that failed, not those torchrun then stopped (SIGTERM, exit code -15)."""
    failed = [r for r, f in failures.items() if not _stopped(f)]
    return sorted(failed or failures)


def _explain_failure(result: Any) -> None:
    ranks = ", ".join(str(r) for r in _failed_ranks(result.failures)) or "?"
    for stall in getattr(result, "stalls", []):  # the watchdog's finding names the cause
        click.echo(f"error: {stall}", err=True)
    click.echo(f"error: the job failed (failed rank(s): {ranks})", err=True)
    try:
        from disttrain.diagnose.logs import diagnose, format_diagnosis
    except ImportError:
        return
    click.echo(format_diagnosis(diagnose(result.log_text)), err=True)
