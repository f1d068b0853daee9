"""One rank of the built-in job or a TrainTask: `python -m disttrain.worker --spec job.yaml`.

torchrun (locally through `disttrain run`, or in a pod) starts one of these per rank with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* set; `run_worker` is the same thing as a
function, which the local launcher forks so workers need not import torch again.
`run_recorded(fn, *args)` is the entry of every rank that torch's elastic agent starts
(this job, `disttrain verify`, the benchmarks): `fn` under torch's @record.

Under plain torchrun (the pod command) no disttrain launcher watches the heartbeats, so
rank 0 does (`disttrain.resilience.watchdog.in_job_watchdog`), and rank 1 watches rank 0 in case
rank 0's own process stops: a stalled rank is named and the job ends within
`launch.timeout_s`. `disttrain run` sets `envvars.WATCHDOG` to keep them off.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from disttrain.distributed.torch_compat import check_torch, running_torch
from disttrain.errors import EXIT_STOPPED, DisttrainError, Failure, SpecError
from disttrain.spec.job import JobSpec

T = TypeVar("T")


def run_worker(spec_data: dict[str, Any]) -> dict[str, Any]:
    """Set up the process group, train, tear down; returns rank's summary."""
    from disttrain.distributed import runtime
    from disttrain.train.build import build_trainer

    spec = JobSpec.model_validate(spec_data)
    recorded: list[BaseException] = []
    try:
        with runtime.setup(spec.launch.backend, spec.launch.timeout_s, threads=spec.train.threads) as rt:
            try:
                summary = build_trainer(spec, rt).fit()
            except Exception as exc:
                # recorded before the group's exit, which can wait for the other ranks to
                # fail too (`Runtime._fail_together`): the launcher may stop this rank then
                _record_failure(spec, exc)
                recorded.append(exc)
                raise
    except Exception as exc:
        if exc not in recorded:   # the group's own set-up failed
            _record_failure(spec, exc)
        raise
    from disttrain.resilience import preemption

    # SIGTERM / SIGINT, even one that came after the last step: the agent is closing and
    # will not read the result (see why in resilience/preemption.py)
    if summary.get("stopped") or preemption.received():
        preemption.exit_after_return(EXIT_STOPPED if summary.get("stopped") else 0)
    return summary


def _record_failure(spec: JobSpec, exc: BaseException) -> None:
    """This rank's typed failure (`errors.Failure`: its kind, message, rank, pid) in the run
    dir, where the launcher reads it (`rundir.write_failure`): the kind travels to
    `disttrain run`'s message and exit status without being read back from text."""
    import os

    from disttrain.distributed import runtime
    from disttrain.rundir import write_failure

    try:
        rank: int | None = runtime.read_env().rank
    except runtime.DistEnvError:
        rank = None
    write_failure(spec.run_dir, Failure.from_exception(exc, rank, os.getpid()))


def run_recorded(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` under torch's @record: the entry of every rank that torch's elastic agent
    starts (the built-in job, `disttrain verify`'s checks, the benchmarks).

    @record writes a failure's traceback to the error file the agent reads, so the
    launcher can name the rank and the cause. Picklable, as the agent's entry must be,
    when `fn` is a module-level function.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)(*args)


@contextlib.contextmanager
def _rank0_watchdog(timeout_s: float) -> Iterator[None]:
    """In a multi-rank job nobody else watches, rank 0 watches every rank while this
    runs, and rank 1 watches rank 0 for the one case rank 0 cannot cover: its own
    process stopped (`watchdog.in_job_watchdog`)."""
    from disttrain.distributed import runtime
    from disttrain.resilience.watchdog import unless_watched

    try:
        env = runtime.read_env()
    except runtime.DistEnvError:
        env = None  # runtime.setup reports it, naming the variable
    with unless_watched(env, timeout_s):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttrain.worker", description=__doc__)
    parser.add_argument("--spec", required=True, help="job spec YAML written by disttrain")
    args = parser.parse_args(argv)
    try:
        spec = JobSpec.from_yaml(args.spec)
        # A pod runs the image's torch: a feature that needs a newer one is named here,
        # before any rank builds the model (disttrain.distributed.torch_compat).
        check_torch(spec, running_torch())
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if spec.task and not spec.task_dir:  # a hand-written spec: its folder, as `disttrain run` sets
        spec.task_dir = str(Path(args.spec).resolve().parent)
    try:
        with _rank0_watchdog(spec.launch.timeout_s):
            summary = run_recorded(run_worker, spec.model_dump())
    except DisttrainError as exc:
        # A failure whose message says what to fix (errors.OUTCOMES: the user's task, a
        # checkpoint not written): @record has put it in torchrun's error file; a traceback
        # of disttrain's frames would only bury it. Any other keeps its traceback.
        outcome = Failure.from_exception(exc).outcome
        if not outcome.alone or outcome.exit_code is None:
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return outcome.exit_code
    # SIGTERM / SIGINT: stopped at a step with a checkpoint, "resume me" (resilience/preemption.py)
    return EXIT_STOPPED if (summary or {}).get("stopped") else 0


if __name__ == "__main__":
    from disttrain.resilience.watchdog import exit_now

    # NOTE: leave like multiprocessing's workers do (`disttrain run`), without teardown.
    # With torch 2.13 the process group outlives destroy_process_group when torch._dynamo
    # was first imported after it was created (every optimizer imports it), so gloo's
    # threads still run during interpreter and C++ static teardown; one rank of a
    # finished plain-torchrun run aborted there ("terminate called without an active
    # exception") and torchrun reported the job as failed. Making the group die in
    # destroy_process_group instead (importing torch._dynamo first) exposed a deadlock in
    # its destructor (it joins a gloo thread that waits for the GIL to free a finished
    # work's tensors). Everything the run writes is closed and flushed by then.
    exit_now(main())
