"""`disttrain top`: a live terminal view of a running job, from its run directory.

    code = watch(Path("runs/main"), Console())             # refresh until the job ends
    watch(Path("runs/main"), Console(record=True), once=True)   # one frame (scripts, tests)

One row per rank: under tp / pp its place in the mesh ("stage 2 of 2, dp 1 of 2": the
verdict compares a pipeline stage's ranks with each other only, train/straggler.py),
step, loss, samples/s, mean step time and its breakdown as a bar (data, compute, comm
wait, optimizer, other), and the age of the rank's last write; the
straggler's row is red and its verdict is printed under the table. The frames come from
`live.read_live`, so this view needs only the files (docs/monitoring.md).

Every wait is bounded: a run dir where no rank writes within `start_timeout_s` raises
RunDirError (exit 2), and a job whose ranks all stop writing for `stale_s` ends the view
with exit 1, saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from disttrain.monitor.live import LiveRun, read_live, wait_live
from disttrain.train.phases import PHASE_NAMES, PHASES
from disttrain.train.straggler import no_verdict, place_label

BAR_WIDTH = 30
# What a user script's live files cannot carry (monitor/script_live.py), said under its frame.
SCRIPT_NOTE = ("a script's run: steps and step times from its hooks; samples/s and epochs are "
               "the script's own (not shown); comm wait includes the backward after the first "
               "gradient")
# One colour per part of the step, the same in the bar and the legend.
COLOURS = {"data_ms": "yellow", "compute_ms": "green", "comm_wait_ms": "magenta",
           "optimizer_ms": "cyan", "other_ms": "bright_black"}


def breakdown_bar(rank: dict[str, Any], width: int = BAR_WIDTH) -> Text:
    """The step's parts as one bar of `width` cells, each part's share in its colour."""
    parts = [(p, max(0.0, float(rank.get(p) or 0.0))) for p in PHASES]
    total = sum(v for _, v in parts)
    bar = Text()
    if total <= 0:
        return bar.append("·" * width, style="bright_black")
    cells, used = [], 0
    for p, v in parts:  # largest-remainder rounding: the cells always add up to width
        cells.append([p, int(v / total * width), v / total * width % 1])
        used += cells[-1][1]
    for cell in sorted(cells, key=lambda c: -c[2])[:width - used]:
        cell[1] += 1
    for p, n, _ in cells:
        bar.append("█" * n, style=COLOURS[p])
    return bar


def legend() -> Text:
    text = Text("bar: ")
    for p in PHASES:
        text.append("█ ", style=COLOURS[p]).append(f"{PHASE_NAMES[p]}  ")
    return text


def frame(run: LiveRun, run_dir: Path, bar_width: int = BAR_WIDTH) -> Group:
    """One frame: a header line, the per-rank table, the legend and the verdict."""
    strag = run.straggler.get("rank") if run.straggler else None
    table = Table(box=None, header_style="bold", pad_edge=False)
    places = [place_label(r) for r in run.ranks]
    meshed = any(places)   # a tp / pp run: where each rank sits
    for name, justify in (("rank", "right"), *((("place", "left"),) if meshed else ()),
                          ("host", "left"), ("device", "left"), ("step", "right"),
                          ("loss", "right"), ("samples/s", "right"),
                          ("step ms", "right"), ("slice MiB", "right"), ("breakdown", "left"),
                          ("age", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for r, place in zip(run.ranks, places):
        age = run.age_s(r)
        state = "done" if r.get("done") else (f"{age:.0f}s" if age is not None else "-")
        table.add_row(str(r.get("rank")), *((place or "-",) if meshed else ()),
                      str(r.get("host", "-")), str(r.get("device", "-")),
                      str(r.get("step", "-")), _num(r.get("loss"), ".4f"),
                      _num(r.get("samples_per_s"), ".1f"), _num(r.get("step_ms"), ".1f"),
                      _num(r.get("slice_used_mib"), ".0f"),   # train/memory.py
                      breakdown_bar(r, bar_width), state,
                      style="bold red" if r.get("rank") == strag else None)
    status = "finished" if run.done else "running"
    head = Text(f"{run_dir}  ·  {len(run.ranks)}/{run.world_size} ranks  ·  {status}", style="bold")
    parts: list[Any] = [head, table, legend()]
    if run.straggler:
        parts.append(Text(str(run.straggler.get("message") or
                              f"rank {strag} is the straggler"), style="bold red"))
    elif len(run.ranks) > 1:
        parts.append(Text(no_verdict(run.ranks), style="green"))
    if run.ranks and all(r.get("script") for r in run.ranks):   # monitor/script_live.py
        parts.append(Text(SCRIPT_NOTE, style="dim"))
    if run.done and not run.ranks:
        parts.append(Text("the job ended before any rank's live file could be read; "
                          f"see `disttrain report {run_dir}`" if run.summary is not None else
                          "the job's pods ended before any rank's live file could be read"))
    return Group(*parts)


def watch(run_dir: Path, console: Console, *, once: bool = False, interval_s: float = 1.0,
          start_timeout_s: float = 60.0, stale_s: float = 300.0,
          read: Callable[[], LiveRun] | None = None) -> int:
    """Show the job until it ends; returns the exit code (0 ended, 1 went silent).

    Args:
        run_dir: the job's run directory (shown in the header; read unless `read` is given).
        console: where to draw (a `Console(record=True)` captures the frames in tests).
        once: draw one frame and return.
        interval_s: seconds between frames.
        start_timeout_s: how long to wait for the first live file (then RunDirError).
        stale_s: end the view when no rank has written for this long and the job has not
            said it is done (a job killed without a summary).
        read: where frames come from (`disttrain k8s top` reads the pods); default the run dir.

    Raises:
        RunDirError: nothing appeared within start_timeout_s.
    """
    run_dir = Path(run_dir)
    reader = read or (lambda: read_live(run_dir))
    run = _first(reader, run_dir, start_timeout_s, read is None)
    # The bar takes what the other columns (~70 cells) leave of the terminal.
    width = max(8, min(40, console.width - 72))
    if once or run.done:
        console.print(frame(run, run_dir, width))
        return 0
    with Live(frame(run, run_dir, width), console=console, refresh_per_second=4,
              transient=False) as live:
        while not run.done:
            age = run.newest_s()
            if age is not None and age > stale_s:
                live.update(frame(run, run_dir, width))
                console.print(f"no rank has written for {age:.0f}s (> --stale {stale_s:g}s): "
                              "the job stopped without finishing; see `disttrain doctor logs`")
                return 1
            time.sleep(interval_s)
            run = reader()
            live.update(frame(run, run_dir, width))
    return 0


def _first(reader: Callable[[], LiveRun], run_dir: Path, timeout_s: float,
           local: bool) -> LiveRun:
    if local:
        return wait_live(run_dir, timeout_s)
    from disttrain.errors import RunDirError

    deadline = time.monotonic() + timeout_s
    while (run := reader()).empty:
        if time.monotonic() >= deadline:
            raise RunDirError(f"no pod of {run_dir} has a live file after {timeout_s:g}s: the "
                              "job has not logged yet; wait longer with --timeout")
        time.sleep(1.0)
    return run


def _num(value: Any, fmt: str) -> str:
    return format(float(value), fmt) if isinstance(value, int | float) else "-"
