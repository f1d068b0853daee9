"""Rank 0's TensorBoard event files under RUN_DIR/tb/ (docs/monitoring.md).

    tensorboard --logdir runs/          # every run's tb/ folder, side by side

`open_events(RUN_DIR / "tb")` is called by `rundir.RunWriter` (rank 0 alone writes the run dir):
it returns None, at the cost of one `find_spec`, when the `tensorboard` package is not
installed (`pip install 'disttrain[tensorboard]'`), so the Trainer never needs it. When it
is, every batch of records RunWriter.log receives is written as scalars, at the
records' optimizer step:

    loss/rank<R>, samples_per_s/rank<R>      train rows, one line per rank
    lr                                        rank 0's row (every rank has the same)
    step_ms/<part>/rank<R>                    the step-time breakdown (data, compute, ...)
    eval/<metric>                             eval rows: loss, accuracy, the task's metrics

The writer is torch's `torch.utils.tensorboard.SummaryWriter` (imported only here), flushed
after each batch, which the Trainer hands over at its record flushes, not per step. A
step's scalars go out as one event (a `Summary` of many values, what TensorBoard's reader
takes as that many scalars), not one event per scalar: without TensorFlow, tensorboard
opens, appends to and closes the event file for every event, and a flush of 50 records of
2 ranks was ~1,900 events, which stalled rank 0 for 58-70 ms (docs/performance.md,
"TensorBoard off the step's path").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disttrain.train.phases import STEP_KEYS

_NOT_METRICS = {"split", "rank", "epoch", "step"}


class EventWriter:
    """Metrics records -> TensorBoard scalars, in one log dir (RUN_DIR/tb)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._w = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, records: list[dict[str, Any]]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        by_step: dict[int, list[Any]] = {}   # one event per step: see the module docstring
        for step, tag, value in _scalars(records):
            by_step.setdefault(step, []).append(Summary.Value(tag=tag, simple_value=float(value)))
        for step, values in by_step.items():
            self._w.file_writer.add_summary(Summary(value=values), step)
        self._w.flush()

    def truncate_after(self, step: int) -> None:
        """On resume: TensorBoard drops this log dir's events after `step` (they are redone),
        as RunWriter drops metrics.jsonl's."""
        from torch.utils.tensorboard import SummaryWriter

        self._w.close()
        self._w = SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self._w.close()


def _scalars(records: list[dict[str, Any]]) -> Iterator[tuple[int, str, float]]:
    """(step, tag, value) of every scalar the records hold (the tags of the module docstring)."""
    for r in records:
        step = int(r.get("step", 0))
        if r.get("split") == "train":
            rank = r.get("rank", 0)
            yield step, f"loss/rank{rank}", r["loss"]
            if "samples_per_s" in r:
                yield step, f"samples_per_s/rank{rank}", r["samples_per_s"]
            if rank == 0 and "lr" in r:
                yield step, "lr", r["lr"]
            for key in STEP_KEYS:   # the timing columns (train/phases.py), under step_ms/
                if isinstance(r.get(key), int | float):
                    yield step, f"step_ms/{key.removesuffix('_ms')}/rank{rank}", r[key]
        elif r.get("split") == "eval":
            for key, value in r.items():
                if key not in _NOT_METRICS and isinstance(value, int | float) \
                        and not isinstance(value, bool):
                    yield step, f"eval/{key}", value


def open_events(log_dir: Path) -> EventWriter | None:
    """An EventWriter into log_dir, or None when tensorboard is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    return EventWriter(log_dir)
