"""`disttrain.fit(task, spec)`: train a TrainTask from a script started by torchrun.

    # train.py — torchrun --nproc_per_node=2 train.py
    import disttrain
    from mytask import make_task

    summary = disttrain.fit(make_task(), disttrain.JobSpec.from_yaml("job.yaml"))
    if summary["rank"] == 0: print(summary["eval"])

Everything `disttrain run --task` gives (the run directory, exact resume, the sync check,
the stall heartbeat), from the user's own entry point. Outside torchrun it trains in one
process. The spec is optional: its `train` section's defaults apply (docs/your-model.md).
Under `disttrain run train.py` it writes into the run directory that command made for the
attempt (`runs/train/run-N`: the logs, summary.json and checkpoints together), unless the
spec sets `train.run_dir`.
"""

from __future__ import annotations

from typing import Any

from disttrain import envvars
from disttrain.spec.job import JobSpec
from disttrain.train.task import TrainTask


def fit(task: TrainTask, spec: JobSpec | None = None, *, backend: str | None = None) -> dict[str, Any]:
    """Set up the process group from torchrun's environment, train `task`, tear down.

    Args:
        task: what to train.
        spec: how (the `train` and `launch` sections); default `JobSpec()`.
        backend: override `spec.launch.backend` (auto: nccl when every local rank has a GPU).

    Returns:
        This rank's summary (the dict rank 0 writes to summary.json), plus `rank`. After
        SIGTERM / SIGINT it holds `stopped` (the ranks stopped at one step with a
        checkpoint): exit `disttrain.errors.EXIT_STOPPED` then (docs/resilience.md).

    Raises:
        TaskError: the task cannot be trained (a bad batch, a non-scalar loss, ...).
    """
    from disttrain.distributed import runtime
    from disttrain.train.build import build_trainer

    spec = spec or JobSpec()
    made = envvars.launcher_run_dir()
    if made and spec.train.run_dir is None:  # under `disttrain run SCRIPT`: the run dir it made
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"run_dir": made})})
    with runtime.setup(backend or spec.launch.backend, spec.launch.timeout_s,
                       threads=spec.train.threads) as rt:
        summary = build_trainer(spec, rt, task).fit()
        summary["rank"] = rt.rank
    return summary
