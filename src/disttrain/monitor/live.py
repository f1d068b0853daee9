"""One frame of a running job, read from its run directory (docs/monitoring.md).

    run = read_live(Path("runs/main"))        # every rank's last live file, the verdict
    run = wait_live(Path("runs/main"), timeout_s=60)   # the same, once a rank has written

Each rank replaces `RUN_DIR/live/rank-<R>.json` atomically at every logging interval
(train/telemetry.py writes it; the schema is in docs/monitoring.md), rank 0 writes
`live/straggler.json` when it names a straggler, and `summary.json` appears when the run
ends. Reading them needs no collective and no connection to the job: a local run dir and
a PVC mounted where the user is read the same. `disttrain k8s top` gets the same files'
text from the pods and parses it with `parse_live`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.errors import RunDirError
from disttrain.rundir import JOB_YAML, LIVE, LIVE_STRAGGLER, SUMMARY
from disttrain.spec.paths import file_problem, is_directory, shown

SKEW_S = 2.0   # how far a shared volume's clock may be behind this machine's


@dataclass
class LiveRun:
    """What the run dir says now: each rank's last live record, the verdict, the summary."""

    ranks: list[dict[str, Any]] = field(default_factory=list)   # ordered by rank
    straggler: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    now: float = 0.0
    ended: bool = False   # the job's processes are gone (its pods ended), files or not

    @property
    def world_size(self) -> int:
        sizes = [int(r.get("world_size") or 0) for r in self.ranks]
        return max([len(self.ranks), *sizes])

    @property
    def done(self) -> bool:
        """The job ended: summary.json is there, or every rank's last write says done."""
        if self.summary is not None or self.ended:
            return True
        return (bool(self.ranks) and len(self.ranks) >= self.world_size
                and all(r.get("done") for r in self.ranks))

    @property
    def empty(self) -> bool:
        return not self.ranks and self.summary is None and not self.ended

    def age_s(self, rank: dict[str, Any]) -> float | None:
        """Seconds since that rank's last write (None when it carries no time)."""
        t = rank.get("time")
        return max(0.0, self.now - float(t)) if isinstance(t, int | float) else None

    def newest_s(self) -> float | None:
        """Seconds since the most recent write of any rank."""
        ages = [a for r in self.ranks if (a := self.age_s(r)) is not None]
        return min(ages) if ages else None


def parse_live(texts: list[str], summary_text: str | None = None,
               now: float | None = None, since: float | None = None) -> LiveRun:
    """A LiveRun from the files' text: rank records, the straggler object, the summary.

    A text that is not a JSON object (a file caught between a pod's `cat` and a restart)
    is skipped: the next frame reads it again. The newest record wins when two claim one
    rank (a restarted job rewrites its files). Records written before `since` (the start
    of this run) are an earlier run's and are skipped.
    """
    by_rank: dict[int, dict[str, Any]] = {}
    straggler: dict[str, Any] | None = None
    for text in texts:
        obj = _loads(text)
        if obj is None:
            continue
        if since is not None and isinstance(obj.get("time"), int | float) and obj["time"] < since:
            continue
        if not isinstance(obj.get("rank"), int):
            continue
        if "step" in obj:
            rank = obj["rank"]
            if rank not in by_rank or obj.get("time", 0) >= by_rank[rank].get("time", 0):
                by_rank[rank] = obj
        elif "message" in obj:
            straggler = obj
    summary = _loads(summary_text) if summary_text else None
    if summary is not None and straggler is None and isinstance(summary.get("straggler"), dict):
        straggler = summary["straggler"]
    if summary is not None and not by_rank:  # ended before a live file: the summary's means
        by_rank = {r["rank"]: {**r, "done": True} for r in summary.get("ranks") or []
                   if isinstance(r, dict) and isinstance(r.get("rank"), int)}
    run = LiveRun([by_rank[r] for r in sorted(by_rank)], straggler, summary,
                  time.time() if now is None else now)
    if run.straggler is None and run.ranks:
        run.straggler = _verdict(run.ranks)
    return run


def read_live(run_dir: Path, now: float | None = None) -> LiveRun:
    """The run dir's live files and summary now (an empty LiveRun when none exist yet).

    The launcher writes job.yaml when a run starts, before any rank does: live files and a
    summary older than it (by more than `SKEW_S`, for a PVC's clock) are an earlier run's
    in the same folder, and `top` started beside a new run must not end on them.
    """
    run_dir = Path(run_dir)
    live = run_dir / LIVE
    texts = [_read(p) for p in sorted(live.glob("rank-*.json"))] if is_directory(live) else []
    started = _mtime(run_dir / JOB_YAML)
    since = started - SKEW_S if started is not None else None
    verdict = _mtime(live / LIVE_STRAGGLER)
    if verdict and (since is None or verdict >= since):
        texts.append(_read(live / LIVE_STRAGGLER))
    summary = _mtime(run_dir / SUMMARY)
    summary_text = _read(run_dir / SUMMARY) if summary and (since is None or summary >= since) else None
    return parse_live([t for t in texts if t], summary_text, now, since)


def wait_live(run_dir: Path, timeout_s: float, poll_s: float = 0.5) -> LiveRun:
    """read_live once some rank has written (or the run ended), waiting at most timeout_s.

    Raises:
        RunDirError: nothing appeared in time; the message says where it looked and why
            that may be.
    """
    run_dir = Path(run_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        run = read_live(run_dir)
        if not run.empty:
            return run
        if time.monotonic() >= deadline:
            problem = file_problem(run_dir, dir_ok=True, missing="does not exist")
            if problem is None and not is_directory(run_dir):
                problem = "is a file, not a run directory"
            where = f"({problem})" if problem else "has no readable live/rank-*.json"
            raise RunDirError(
                f"{shown(run_dir)} {where} after {timeout_s:g}s: no rank has logged yet; check that the "
                f"job runs with --run-dir {run_dir} (the files appear at the first logging "
                f"interval, --log-every-steps), or wait longer with --timeout")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def _verdict(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The straggler among the ranks' live means, by the Trainer's own rule
    (train/straggler.py), so top names the rank the run's summary will name."""
    if len(ranks) < 2 or not all("step_ms" in r for r in ranks):
        return None
    from disttrain.train.straggler import find_straggler

    return find_straggler(ranks)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except (OSError, ValueError):
        return None


def _read(path: Path) -> str | None:
    """The file's text, or None when it cannot be read now (not there yet, being replaced,
    unreadable: wait_live's timeout says so if it lasts)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None


def _loads(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
