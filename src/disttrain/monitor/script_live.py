"""Live files for a user's own script, from its hooks alone (docs/monitoring.md, "Scripts").

    live = ScriptLive(run_dir, rank=1, world_size=2, read=hooks.figures)
    live.start()                       # a daemon thread: live/rank-1.json every second
    live.stop()                        # the last write, `done` true
    finish_script_run(run_dir)         # the launcher, after the ranks: metrics.jsonl, summary.json

Why: `disttrain top`, `disttrain report` and the straggler verdict read the run directory
(`monitor/live.py`, `monitor/report.py`); a built-in or task run fills it through the
Trainer, a script through nothing. The script's heartbeat already hooks its optimizer
steps and forward passes (`resilience.script_heartbeat`), so each script rank writes the
Trainer's live-file format (its columns: `train/phases.py`) from those counters:
`live/rank-<R>.json` (replaced every `INTERVAL_S`) and one train row per interval in
`live/rank-<R>.jsonl` (each rank its own
file: no two processes append to one). When the run ends, `disttrain run` merges the rows
into metrics.jsonl and writes summary.json (whole-run means per rank, the verdict), so
`disttrain report` works on a script's run dir too.

What a script's files carry, and what they cannot: `step` (optimizer steps), `steps_per_s`,
`step_ms` and its parts, from the hooks' boundaries (the first step, which holds the
setup, left out): `data_ms` from an optimizer step's end to the next forward (loading and
the loop's own work), `compute_ms` from that forward to the step's first gradient (the
forward and the start of backward), `comm_wait_ms` from the first gradient to the
optimizer step (the rest of backward and, under DDP, the wait in its all-reduce: the
backward compute after the first gradient lands here too, so it is an upper bound),
`optimizer_ms`, `other_ms`; `loss` only when the script calls `.backward()` on a scalar
without a GradScaler (a scaled loss is not the loss). There is no `epoch` and no
`samples_per_s` (the batch size is the script's own).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import Any

from disttrain.rundir import LIVE, METRICS, SUMMARY, read_metrics, write_text_atomic
from disttrain.train.phases import STEP_KEYS

INTERVAL_S = 1.0


class ScriptLive:
    """One script rank's live files, written by a daemon thread from `read()`.

    Args:
        run_dir: the run's directory (`live/` is made in it).
        rank, world_size: this rank and the job's size.
        read: returns (steps, {part: seconds summed since the last call, `timed`: over how
            many steps}, loss or None),
            or None when the rank's figures are no longer the script's (the Trainer writes
            them); called from the thread once per interval.
    """

    def __init__(self, run_dir: Path, rank: int, world_size: int,
                 read: Callable[[], tuple[int, dict[str, float], float | None] | None]) -> None:
        self.dir = Path(run_dir) / LIVE
        self.rank, self.world_size, self.read = rank, world_size, read
        self.path = self.dir / f"rank-{rank}.json"
        self.rows = self.dir / f"rank-{rank}.jsonl"
        self._base = {"rank": rank, "world_size": world_size, "host": socket.gethostname(),
                      "pid": os.getpid(), "device": "-", "script": True}
        self._last: dict[str, Any] = {}
        self._steps, self._t = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.enabled = True

    def start(self) -> ScriptLive:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._off(exc)
            return self
        self._thread = threading.Thread(target=self._run, name="disttrain-live", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self.write()

    def write(self, done: bool = False) -> None:
        """This interval's figures to `rank-<R>.json` (and a row when steps were made)."""
        if not self.enabled:
            return
        figures = self.read()
        if figures is None:   # disttrain's Trainer runs inside the script: its files now
            self.enabled = False
            return
        steps, sums, loss = figures
        now = time.monotonic()
        made, elapsed = steps - self._steps, now - self._t
        if made > 0:
            self._last = {"step": steps, "steps_per_s": round(made / elapsed, 3),
                          **_means(sums)}
            if loss is not None:
                self._last["loss"] = loss
            self._base["device"] = _device()
            self._append({"split": "train", **self._base, **self._last})
            self._steps, self._t = steps, now
        rec = {**self._base, "device": _device(), "step": steps, **self._last,
               "time": round(time.time(), 3), "done": done}
        self._replace(rec)

    def stop(self) -> None:
        """The script ended: one last write with `done` true."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self.write(done=True)

    def _append(self, row: dict[str, Any]) -> None:
        try:
            with open(self.rows, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        except OSError as exc:
            self._off(exc)

    def _replace(self, rec: dict[str, Any]) -> None:
        try:
            write_text_atomic(self.path, json.dumps(rec))
        except OSError as exc:
            self._off(exc)

    def _off(self, exc: OSError) -> None:
        if self.enabled:
            self.enabled = False
            print(f"warning: rank {self.rank}: live status files off ({self.dir}: {exc}); "
                  f"the script goes on", file=sys.stderr, flush=True)


def _means(sums: dict[str, float]) -> dict[str, float]:
    """ms per timed step of each part; `other_ms` is what the parts leave of the step."""
    steps = sums.pop("timed", 0.0)
    if not steps:   # only the first step so far: its time is the setup's
        return {}
    out = {f"{k}_ms": round(1000 * v / steps, 3) for k, v in sums.items()}
    if "step_ms" in out:
        parts = sum(v for k, v in out.items() if k != "step_ms")
        out["other_ms"] = round(max(0.0, out["step_ms"] - parts), 3)
    return out


def _device() -> str:
    """The rank's CUDA device once the script initialised CUDA, else cpu (never initialises it)."""
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_initialized():
            return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def finish_script_run(run_dir: Path, exit_code: int, wall_s: float) -> Path | None:
    """After a script's ranks ended: their rows into metrics.jsonl, whole-run means per
    rank and the straggler verdict into summary.json; None when no rank stepped an optimizer."""
    from disttrain.train.straggler import find_straggler

    run_dir = Path(run_dir)
    rows: list[dict[str, Any]] = []
    for path in sorted((run_dir / LIVE).glob("rank-*.jsonl")):
        rows += [r for r in read_metrics(path) if isinstance(r.get("rank"), int)]
    if not rows:
        return None
    rows.sort(key=lambda r: (r.get("step", 0), r["rank"]))
    write_text_atomic(run_dir / METRICS, "".join(json.dumps(r) + "\n" for r in rows))
    ranks = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["rank"] == rank]
        entry: dict[str, Any] = {k: mine[-1].get(k) for k in ("rank", "host", "device")}
        for key in STEP_KEYS:   # the Trainer's columns (train/phases.py)
            vals = [r[key] for r in mine if isinstance(r.get(key), int | float)]
            if vals:
                entry[key] = round(fmean(vals), 3)
        ranks.append(entry)
    losses = [r["loss"] for r in rows if r.get("step") == rows[-1]["step"] and "loss" in r]
    summary = {"script": True, "world_size": max(r.get("world_size", 1) for r in rows),
               "steps": max(r["step"] for r in rows), "exit_code": exit_code,
               "final_loss": fmean(losses) if losses else None, "wall_s": round(wall_s, 1),
               "ranks": ranks, "straggler": find_straggler(ranks),
               "not_available": "epochs, samples/s, evaluation: a script's own numbers; "
                                "comm_wait_ms holds the backward after its first gradient "
                                "(docs/monitoring.md)"}
    write_text_atomic(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return run_dir / SUMMARY
