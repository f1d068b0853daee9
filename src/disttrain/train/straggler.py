"""The straggler verdict: which rank the others wait for, and why (docs/performance.md).

    verdict = find_straggler(summary["ranks"])     # or the rows of one logging interval
    verdict["message"]   # "rank 1 (host job-1, cuda:0) is the straggler: it computes 2.8x ..."

Pure Python, no torch: `disttrain top` and `disttrain report` read the same entries from
the run directory (`live/rank-<R>.json`, summary.json's `ranks`) and call this function
too, so the Trainer's verdict and theirs cannot differ.

Why the causes are told apart this way: under DDP every rank ends a step at the same
moment (the gradient all-reduce waits for the last rank), so step time and samples/s are
the same on all ranks and name nobody. What differs is where each rank's time goes: the
slow rank spends longer computing (a smaller core or SM share: HAMi's `gpucores`) or
waiting for its data (its DataLoader), and the others spend that difference waiting in
the all-reduce. So a rank is named when its compute or data time exceeds the median of
the OTHER ranks' by more than `threshold` (the median of the others, not of all ranks:
with two ranks the median of all would be halfway to the straggler and hide half its
factor). A rank that waits longer in the all-reduce than the others while it computes and
loads as fast as they do is named for "communication": its own transfers are the slow
part. Differences under `MIN_SHARE` of a step are noise, whatever their ratio.
"""

from __future__ import annotations

from statistics import median
from typing import Any

__all__ = ["CAUSES", "MIN_SHARE", "WINDOWS", "StragglerWatch", "find_straggler"]

CAUSES = {"compute": "compute_ms", "data": "data_ms", "communication": "comm_wait_ms"}
MIN_SHARE = 0.05    # an excess below 5% of the median step is never a straggler
_AS_FAST = 0.9      # "computes and loads as fast": at least 0.9x the others' compute + data
_FLOOR_MS = 1e-3    # a median of 0 ms (no data wait at all) divides as 1 µs
WINDOWS = 3         # the live verdict: the same rank, for the same cause, in this many consecutive intervals


def find_straggler(ranks: list[dict[str, Any]], threshold: float = 1.5) -> dict[str, Any] | None:
    """The rank the others wait for, or None when no rank stands out.

    Args:
        ranks: one entry per rank, shaped like summary.json's `ranks` (`rank`, `host`,
            `device`, `step_ms` and the phases of `train/phases.py`; an optional `limit`, the
            HAMi limit the rank runs under, goes into the message).
        threshold: how many times the other ranks' median a rank's time in one cause
            must exceed to be named (1.5: 50% slower).

    Returns:
        {rank, host, device, factor, cause, message} (cause: compute | data |
        communication; factor: the rank's time in its cause / the other ranks' median),
        or None.
    """
    if len(ranks) < 2:
        return None
    step = median(float(e.get("step_ms") or 0.0) for e in ranks)
    if step <= 0:
        return None
    floor = MIN_SHARE * step
    best: tuple[float, dict[str, Any], str, float] | None = None   # (excess, entry, cause, factor)
    for cause in ("compute", "data"):
        best = _worst(ranks, CAUSES[cause], cause, threshold, floor, best)
    if best is None:
        fast = [e for e in ranks if _load(e) >= _AS_FAST * median(_load(o) for o in ranks if o is not e)]
        best = _worst(ranks, CAUSES["communication"], "communication", threshold, floor, None, fast)
    if best is None:
        return None
    _, entry, cause, factor = best
    return {"rank": entry.get("rank"), "host": entry.get("host"), "device": entry.get("device"),
            "factor": round(factor, 2), "cause": cause,
            "message": _message(entry, cause, factor, ranks)}


def _load(entry: dict[str, Any]) -> float:
    return float(entry.get("compute_ms") or 0.0) + float(entry.get("data_ms") or 0.0)


def _worst(ranks: list[dict[str, Any]], key: str, cause: str, threshold: float, floor: float,
           best: tuple[float, dict[str, Any], str, float] | None,
           candidates: list[dict[str, Any]] | None = None,
           ) -> tuple[float, dict[str, Any], str, float] | None:
    """`best`, or the entry of `candidates` that exceeds the others' median of `key` the
    most, when it does so by more than `threshold` times and `floor` ms."""
    for entry in ranks if candidates is None else candidates:
        value = float(entry.get(key) or 0.0)
        others = median(float(o.get(key) or 0.0) for o in ranks if o is not entry)
        factor = value / max(others, _FLOOR_MS)
        excess = value - others
        if factor > threshold and excess >= floor and (best is None or excess > best[0]):
            best = (excess, entry, cause, factor)
    return best


def _message(entry: dict[str, Any], cause: str, factor: float, ranks: list[dict[str, Any]]) -> str:
    host = f"host {entry['host']}" if entry.get("host") else None
    where = ", ".join(str(v) for v in (host, entry.get("device"), entry.get("limit")) if v)
    who = f"rank {entry.get('rank')}" + (f" ({where})" if where else "")
    others = [o for o in ranks if o is not entry]
    wait = median(float(o.get("comm_wait_ms") or 0.0) / max(float(o.get("step_ms") or 0.0), _FLOOR_MS)
                  for o in others)
    if cause == "compute":
        what = f"it computes {factor:.1f}x longer per step than the median rank"
    elif cause == "data":
        what = f"it waits {factor:.1f}x longer for its data (DataLoader) per step than the median rank"
    else:
        return (f"{who} is the straggler: it waits {factor:.1f}x longer in the gradient all-reduce "
                f"than the median rank while it computes and loads as fast: its network is the slow part")
    return f"{who} is the straggler: {what}; the others wait for it in the all-reduce {wait:.0%} of each step"


class StragglerWatch:
    """Rank 0's live verdict: said once, when the same rank is named for the same cause
    in `WINDOWS` consecutive logging intervals (one slow interval is noise: a checkpoint,
    a neighbour's burst), so a verdict needs a slowdown that lasts."""

    def __init__(self, threshold: float = 1.5) -> None:
        self.threshold = threshold
        self.verdict: dict[str, Any] | None = None
        self._streak: tuple[Any, Any, int] = (None, None, 0)

    def window(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """One interval's per-rank means; returns the verdict the first time it is made."""
        if self.verdict is not None:
            return None
        v = find_straggler(entries, self.threshold)
        if v is None:
            self._streak = (None, None, 0)
            return None
        rank, cause, n = self._streak
        n = n + 1 if (rank, cause) == (v["rank"], v["cause"]) else 1
        self._streak = (v["rank"], v["cause"], n)
        if n >= WINDOWS:
            self.verdict = v
            return v
        return None
