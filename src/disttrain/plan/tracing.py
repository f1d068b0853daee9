"""The plan's one entry for tracing a job's memory: data-parallel jobs by `trace`, tp / pp
jobs on the run's real split by `parallel`. It lives apart from both because `parallel`
builds on `trace`'s helpers: a dispatch inside `trace` would import `parallel` back (an
import cycle, tests/test_architecture.py). docs/memory.md.
"""

from __future__ import annotations

from typing import Any

from disttrain.plan.parallel import trace_parallel
from disttrain.plan.trace import Knobs, TensorPeak, first_batch, trace_data_parallel
from disttrain.train.task import TrainTask

__all__ = ["trace_memory"]


def trace_memory(task: TrainTask, knobs: Knobs, batch: Any = None) -> TensorPeak:
    """Trace two optimizer steps of the job's busiest rank and return its tensor memory.

    Args:
        task: the job's TrainTask.
        knobs: the settings to trace with (strategy as it will run, world size, tp / pp ...).
        batch: one real batch of the per-rank shape; default: read from the task's data.

    Raises:
        TaskError: the model, batch or step cannot be traced (the message says why).
        SpecError: a tp / pp combination the run refuses too.
    """
    if batch is None:
        batch = first_batch(task, knobs.batch_size, knobs.world_size)
    if knobs.model_parallel:
        return trace_parallel(task, knobs, batch)
    return trace_data_parallel(task, knobs, batch)
