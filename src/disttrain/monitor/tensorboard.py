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
after each batch, which the Trainer hands over at its record flushes, not per step.
"""

from __future__ import annotations

import importlib.util
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
        add = self._w.add_scalar
        for r in records:
            step = int(r.get("step", 0))
            if r.get("split") == "train":
                rank = r.get("rank", 0)
                add(f"loss/rank{rank}", r["loss"], step)
                if "samples_per_s" in r:
                    add(f"samples_per_s/rank{rank}", r["samples_per_s"], step)
                if rank == 0 and "lr" in r:
                    add("lr", r["lr"], step)
                for key in STEP_KEYS:   # the timing columns (train/phases.py), under step_ms/
                    if isinstance(r.get(key), int | float):
                        add(f"step_ms/{key.removesuffix('_ms')}/rank{rank}", r[key], step)
            elif r.get("split") == "eval":
                for key, value in r.items():
                    if key not in _NOT_METRICS and isinstance(value, int | float) \
                            and not isinstance(value, bool):
                        add(f"eval/{key}", value, step)
        self._w.flush()

    def truncate_after(self, step: int) -> None:
        """On resume: TensorBoard drops this log dir's events after `step` (they are redone),
        as RunWriter drops metrics.jsonl's."""
        from torch.utils.tensorboard import SummaryWriter

        self._w.close()
        self._w = SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self._w.close()


def open_events(log_dir: Path) -> EventWriter | None:
    """An EventWriter into log_dir, or None when tensorboard is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    return EventWriter(log_dir)
