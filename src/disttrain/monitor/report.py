"""`disttrain report`: a run in one picture and one table (docs/monitoring.md).

    rep = load_report(Path("runs/main"))      # metrics.jsonl + summary.json, checked
    png = plot_report(rep)                     # RUN_DIR/report.png
    console.print(summary_tables(rep))         # the summary, the ranks, the verdict

report.png has three panels: the training loss per rank over the optimizer steps, the
samples/s per rank over the steps, and each rank's mean step time split into data,
compute, comm wait, optimizer and other as stacked horizontal bars, the straggler's bar
labelled in red and its verdict as the figure's subtitle (under pp each bar says its
stage, and the table each rank's place in the mesh: train/straggler.py compares a stage's
ranks with each other only). The per-rank figures come from
summary.json's `ranks` (whole-run means); a run whose summary predates them falls back to
the means of its metrics.jsonl rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from disttrain.errors import RunDirError
from disttrain.plan.feedback import feedback_lines, memory_feedback
from disttrain.rundir import METRICS, REPORT_PNG, SUMMARY, read_metrics
from disttrain.spec.paths import check_readable_file, shown
from disttrain.train.phases import PHASE_NAMES, PHASES
from disttrain.train.straggler import no_verdict, place_label, stage_of

# The same part colours as `disttrain top` (matplotlib's names of rich's colours).
COLOURS = {"data_ms": "#e6b400", "compute_ms": "#2ca02c", "comm_wait_ms": "#b04fc0",
           "optimizer_ms": "#17becf", "other_ms": "#9a9a9a"}
SHORT = {"data_ms": "data", "compute_ms": "compute", "comm_wait_ms": "comm",
         "optimizer_ms": "optim", "other_ms": "other"}
# summary.json's run-level figures the table shows, in order (absent ones are skipped).
SUMMARY_ROWS = (("world_size", "world size", "d"), ("strategy", "strategy", "s"),
                ("backend", "backend", "s"), ("epochs", "epochs", "d"), ("steps", "steps", "d"),
                ("final_loss", "final loss", ".4f"), ("test_loss", "test loss", ".4f"),
                ("test_accuracy", "test accuracy", ".4f"), ("samples_per_s", "samples/s", ".1f"),
                ("wall_s", "wall s", ".1f"), ("params_in_sync", "params in sync", "s"))


@dataclass
class Report:
    run_dir: Path
    summary: dict[str, Any]
    train: list[dict[str, Any]]     # metrics.jsonl's train rows
    ranks: list[dict[str, Any]]     # per-rank whole-run means, ordered by rank

    @property
    def straggler(self) -> dict[str, Any] | None:
        return self.summary.get("straggler")

    def as_dict(self) -> dict[str, Any]:
        """What `--json` prints: the summary's figures, the ranks, the verdict, the picture."""
        return {"run_dir": str(self.run_dir), "report_png": str(self.run_dir / REPORT_PNG),
                **{k: self.summary.get(k) for k, _, _ in SUMMARY_ROWS},
                "ranks": self.ranks, "straggler": self.straggler,
                "memory": memory_feedback(self.summary, self.run_dir)}


def load_report(run_dir: Path) -> Report:
    """The run's metrics and summary.

    Raises:
        RunDirError: run_dir is not a run directory, or its run has not finished; the
            message names the missing or unreadable file.
    """
    run_dir = Path(run_dir)
    metrics, summary_path = run_dir / METRICS, run_dir / SUMMARY
    check_readable_file(metrics, missing="not found; give the run directory of a `disttrain run` "
                        "(its --run-dir, default runs/<name>)", error=RunDirError)
    check_readable_file(summary_path, missing="not found; the run has not finished (watch it "
                        f"with `disttrain top {shown(run_dir)}`)", error=RunDirError)
    summary = _parse(summary_path, lambda: json.loads(summary_path.read_text(encoding="utf-8")))
    rows = _parse(metrics, lambda: read_metrics(metrics))
    if not isinstance(summary, dict):
        raise RunDirError(f"{summary_path}: not a JSON object; was it written by disttrain?")
    train = [r for r in rows if isinstance(r, dict) and r.get("split") == "train"
             and {"rank", "step", "loss"} <= r.keys()]
    ranks = [r for r in summary.get("ranks") or [] if isinstance(r, dict) and "rank" in r] \
        or _ranks_from_rows(train)
    return Report(run_dir, summary, train, sorted(ranks, key=lambda r: r["rank"]))


def _parse(path: Path, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path}: not JSON ({exc}); was it written by disttrain?") from None


def _ranks_from_rows(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-rank means of metrics.jsonl's rows, for a summary without `ranks`."""
    out = []
    for rank in sorted({r["rank"] for r in train}):
        mine = [r for r in train if r["rank"] == rank]
        entry: dict[str, Any] = {"rank": rank}
        for key in ("samples_per_s", "step_ms", *PHASES):
            vals = [r[key] for r in mine if isinstance(r.get(key), int | float)]
            if vals:
                entry[key] = round(fmean(vals), 3)
        out.append(entry)
    return out


def plot_report(rep: Report) -> Path:
    """Write RUN_DIR/report.png (atomically) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strag = rep.straggler.get("rank") if rep.straggler else None
    fig, (ax_loss, ax_sps, ax_bar) = plt.subplots(1, 3, figsize=(16, 5), dpi=100)
    by_rank = {rank: sorted((r for r in rep.train if r["rank"] == rank), key=lambda r: r["step"])
               for rank in sorted({r["rank"] for r in rep.train})}
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 3]  # red: the straggler
    for i, (rank, rows) in enumerate(by_rank.items()):
        style = ({"linewidth": 2.4, "color": "#d62728", "zorder": 3} if rank == strag
                 else {"linewidth": 1.2, "color": palette[i % len(palette)]})
        label = f"rank {rank}" + (" (straggler)" if rank == strag else "")
        ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, **style)
        ax_sps.plot([r["step"] for r in rows], [r.get("samples_per_s", float("nan")) for r in rows],
                    label=label, **style)
    for ax, title, ylabel in ((ax_loss, "training loss per rank", "loss"),
                              (ax_sps, "throughput per rank", "samples/s (job-wide, as logged)")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if by_rank:
            ax.legend(fontsize=8)
    _breakdown(ax_bar, rep.ranks, strag)
    title = f"{rep.run_dir.name}: {rep.summary.get('world_size', len(rep.ranks))} ranks, " \
            f"{rep.summary.get('strategy', '?')}, {rep.summary.get('steps', '?')} steps"
    fig.suptitle(title, fontsize=13, fontweight="bold")
    verdict = rep.straggler.get("message") if rep.straggler else no_verdict(rep.ranks, ended=True)
    fig.text(0.5, 0.905, verdict, ha="center", fontsize=10,
             color="#d62728" if rep.straggler else "#2ca02c")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    out = rep.run_dir / REPORT_PNG
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RunDirError(f"{out}: cannot write: {exc.strerror or exc}; copy the run dir "
                          "somewhere writable and report on the copy") from None
    finally:
        plt.close(fig)
    return out


def _breakdown(ax: Any, ranks: list[dict[str, Any]], strag: int | None) -> None:
    """Stacked horizontal bars, one per rank (rank 0 on top): where each step's time goes."""
    ax.set_title("mean step time per rank")
    ax.set_xlabel("ms per optimizer step")
    timed = [r for r in ranks if any(isinstance(r.get(p), int | float) for p in PHASES)]
    if not timed:
        ax.text(0.5, 0.5, "no step-time breakdown in this run", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
        ax.set_yticks([])
        return
    ys = list(range(len(timed)))[::-1]
    left = [0.0] * len(timed)
    for p in PHASES:
        widths = [float(r.get(p) or 0.0) for r in timed]
        ax.barh(ys, widths, left=left, color=COLOURS[p], label=PHASE_NAMES[p], height=0.7)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(ys, [_who(r) for r in timed])
    for tick, r in zip(ax.get_yticklabels(), timed):
        if r["rank"] == strag:
            tick.set_color("#d62728")
            tick.set_fontweight("bold")
    for y, total in zip(ys, left):
        ax.text(total, y, f" {total:.1f}", va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.15 or 1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=5,
              frameon=False, handlelength=1.2, columnspacing=1.0)
    ax.grid(axis="x", alpha=0.3)


def summary_tables(rep: Report) -> Group:
    """The summary as rich tables: the run's figures, one row per rank, the verdict."""
    run = Table(title=f"run {rep.run_dir}", show_header=False, title_justify="left",
                box=box.SIMPLE)
    run.add_column("", style="bold")
    run.add_column("", justify="right")
    for key, label, fmt in SUMMARY_ROWS:
        value = rep.summary.get(key)
        if value is not None:
            run.add_row(label, fmt_value(value, fmt))
    strag = rep.straggler.get("rank") if rep.straggler else None
    ranks = Table(title="per rank (whole-run means, ms per optimizer step)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    places = [place_label(r) for r in rep.ranks]
    meshed = any(places)   # tp / pp: each rank's place ("stage 2 of 2, dp 1 of 2")
    for name in ("rank", *(("place",) if meshed else ()), "host", "device", "samples/s", "step",
                 *(SHORT[p] for p in PHASES)):
        ranks.add_column(name, justify="left" if name in ("place", "host", "device") else "right",
                         no_wrap=True)
    for r, place in zip(rep.ranks, places):
        ranks.add_row(str(r["rank"]), *((place or "-",) if meshed else ()),
                      str(r.get("host", "-")), str(r.get("device", "-")),
                      fmt_value(r.get("samples_per_s"), ".1f"), fmt_value(r.get("step_ms"), ".1f"),
                      *(fmt_value(r.get(p), ".1f") for p in PHASES),
                      style="bold red" if r["rank"] == strag else None)
    verdict = (Text(str(rep.straggler.get("message")), style="bold red") if rep.straggler
               else Text(no_verdict(rep.ranks, ended=True), style="green"))
    memory = memory_feedback(rep.summary, rep.run_dir)   # measured vs asked (plan/feedback.py)
    lines = [Text(line) for line in feedback_lines(memory)] if memory else []
    if rep.summary.get("script"):   # a user script's run: what it cannot show (monitor/script_live.py)
        from disttrain.monitor.top import SCRIPT_NOTE

        lines.append(Text(SCRIPT_NOTE, style="dim"))
    return Group(run, ranks, verdict, *lines, Text(f"picture: {rep.run_dir / REPORT_PNG}"))


def _who(rank: dict[str, Any]) -> str:
    """A bar's label: "rank 3", under pp "rank 3 · stage 2 of 2" (tp / dp stay in the table)."""
    stage = stage_of(rank)
    return f"rank {rank['rank']}" + (f" · stage {stage[0] + 1} of {stage[1]}" if stage else "")


def fmt_value(value: Any, fmt: str) -> str:
    """How the table writes a figure (tests format summary.json's numbers the same way)."""
    if value is None:
        return "-"
    if fmt == "s" or isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return format(value, fmt)
