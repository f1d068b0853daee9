"""Rank 0's console output: the start banner, a per-epoch table, a progress bar on a TTY.

Every method is a no-op on ranks other than 0, so callers never need their own guard.
The progress bar is drawn only when stdout is a terminal (logs stay clean in pods/CI).
"""

from __future__ import annotations

import math
import sys
from typing import Any

COLUMNS = ("epoch", "train loss", "test loss", "test acc", "samples/s")
WIDTHS = (5, 10, 9, 8, 10)


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


class _NoProgress:
    def update(self, completed: int) -> None:
        pass

    def close(self) -> None:
        pass


class _RichProgress:
    def __init__(self, total: int, epoch: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._p = Progress("epoch " + str(epoch), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), transient=True)
        self._task = self._p.add_task("train", total=total)
        self._p.start()

    def update(self, completed: int) -> None:
        self._p.update(self._task, completed=completed)

    def close(self) -> None:
        self._p.stop()


class EpochTable:
    """The per-epoch table of `disttrain run` (printed row by row as epochs end)."""

    def __init__(self, enabled: bool, stream: Any = None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _print(self, text: str = "") -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def header(self, info: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._print(
            f"disttrain: {info.get('workload')} | strategy {info.get('strategy')} | backend "
            f"{info.get('backend')} | world size {info.get('world_size')} | device "
            f"{info.get('device')}")
        self._print(
            f"batch {info.get('batch_size')}/rank x {info.get('world_size')} ranks x "
            f"{info.get('grad_accum')} accum = global batch {info.get('global_batch')} | lr "
            f"{info.get('lr_base'):g} -> {info.get('lr_effective'):g} ({info.get('lr_scaling')})"
            f" | precision {info.get('precision')}")
        self._print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, WIDTHS)))

    def progress(self, total: int, epoch: int) -> _NoProgress | _RichProgress:
        if self.enabled and self.tty:
            return _RichProgress(total, epoch)
        return _NoProgress()

    def row(self, epoch: int, train_loss: float, test_loss: float, test_acc: float,
            sps: float) -> None:
        cells = (str(epoch + 1), _fmt(train_loss, ".4f"), _fmt(test_loss, ".4f"),
                 _fmt(test_acc, ".4f"), _fmt(sps, ",.0f"))
        self._print("  ".join(c.rjust(w) for c, w in zip(cells, WIDTHS)))

    def footer(self, summary: dict[str, Any]) -> None:
        n = summary.get("world_size")
        if summary.get("params_check"):  # tp/pp: the ranks hold different shards or stages
            verdict = (f"parameters in sync on all {n} ranks: "
                       f"{'yes' if summary.get('params_in_sync') else 'NO (ranks diverged)'}; "
                       f"{summary['params_check']}")
        elif summary.get("params_in_sync"):
            verdict = f"parameters identical on all {n} ranks: yes"
        else:
            verdict = f"parameters identical on all {n} ranks: NO (ranks diverged)"
        self._print(f"{verdict} (sha256 {str(summary.get('params_sha256'))[:16]}...)")
        if summary.get("test_accuracy") is not None or not summary.get("eval"):
            result = f"test accuracy {_fmt(summary.get('test_accuracy'), '.4f')}"
        else:   # a task without an accuracy metric: its eval loss and metrics
            result = "eval " + ", ".join(f"{k} {_fmt(v, '.4f')}" for k, v in summary["eval"].items())
        self._print(f"{result} | {_fmt(summary.get('samples_per_s'), ',.0f')} samples/s | "
                    f"run dir {summary.get('run_dir')}")
