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

A rank named for compute whose compute used about the CPU time of the others' (at most
1.5x their median: the same work) while its extra compute time was mostly not CPU time (the
Trainer's `compute_cpu_ms`, the training thread's own CPU time in compute, on CPU devices)
is named for "cpu share" instead: it had as much to do as the others and waited for a
core, because other processes run on its cores or its pod's CPU limit throttles it. The
first condition keeps a busy machine from hiding more work: when every rank gets a third
of a core, a rank with 3x the work also spends most of its extra time waiting, and its
long compute waits more per ms of CPU than the others' short ones (a burst longer than
the scheduler's slice is cut into several; the test suite on 3 workers over 2 cores: 16.8
ms of CPU against 3.8, and in another run the 3x rank's wall per CPU-ms above 1.5x the
others', both named "cpu share" by earlier rules). On a shared node waiting for a core is
the usual cause, and its fix (a CPU request / limit, fewer threads, another node) is not
the fix for more work. Under tp / pp a rank's compute holds its waits for its
partners by design, so the distinction is made only for ranks without such a mesh.

Under pipeline parallel (issue 26 item 4) each entry may carry its place in the mesh,
`mesh = {"pp": [stage, stages], "dp_shard": [i, n], "tp": [i, n]}` (the dimensions of
`distributed/mesh.py` larger than 1; `telemetry.mesh_place`), and a rank is compared only
with the ranks of its own stage: stages do different work by design (the first embeds,
the last runs the head and the loss; GPipe / 1F1B leave `(pp - 1) / (m + pp - 1)` of a
step idle as bubbles, spread unevenly over the stages, and a stage's waits for its
neighbours' activations and gradients happen inside the schedule's step, which the timer
counts as compute: pytorch.org/docs/stable/distributed.pipelining.html). Comparing a last
stage with a first would name the pipeline's shape, not a slow rank. So with one rank per
stage (pp alone) nobody is named, and `no_verdict` says why. Ranks of one stage (the
data-parallel replicas of pp x dp) do the same work on different data, as DDP's ranks do.
A slow rank also slows its own pipeline (its partners in other stages wait for it inside
their schedule step, counted as their compute), so its partners may stand out in their
stages too: the message names them ("same pipeline"), and the rank with the most excess
time is the one named. tp ranks of one stage do the same work: they are compared as usual.
"""

from __future__ import annotations

from statistics import median
from typing import Any

__all__ = ["CAUSES", "CPU_KEY", "MIN_SHARE", "WINDOWS", "StragglerWatch", "find_straggler", "no_verdict",
           "place_label", "stage_of"]

CAUSES = {"compute": "compute_ms", "cpu share": "compute_ms", "data": "data_ms",
          "communication": "comm_wait_ms"}
CPU_KEY = "compute_cpu_ms"   # the CPU time in compute (train/phases.py); absent or 0: not measured
_CPU_PART = 0.5     # "cpu share": less than half the extra compute time was CPU time,
_SAME_WORK = 1.5    # and its compute's CPU time at most 1.5x the others' median
MIN_SHARE = 0.05    # an excess below 5% of the median step is never a straggler
_AS_FAST = 0.9      # "computes and loads as fast": at least 0.9x the others' compute + data
_FLOOR_MS = 1e-3    # a median of 0 ms (no data wait at all) divides as 1 µs
WINDOWS = 3         # the live verdict: the same rank, for the same cause, in this many consecutive intervals
# how a mesh dimension reads in a rank's place ("stage 2 of 2, dp 1 of 2")
DIM_LABELS = {"pp": "stage", "dp_replicate": "replica", "dp_shard": "dp", "tp": "tp"}


def find_straggler(ranks: list[dict[str, Any]], threshold: float = 1.5) -> dict[str, Any] | None:
    """The rank the others wait for, or None when no rank stands out.

    Args:
        ranks: one entry per rank, shaped like summary.json's `ranks` (`rank`, `host`,
            `device`, `step_ms` and the phases of `train/phases.py`; an optional `limit`, the
            HAMi limit the rank runs under, goes into the message; an optional `mesh`, its
            place in a tp / pp mesh: under pp a rank is compared with its own stage only).
        threshold: how many times the other ranks' median a rank's time in one cause
            must exceed to be named (1.5: 50% slower).

    Returns:
        {rank, host, device, factor, cause, message} (cause: compute | cpu share | data |
        communication; factor: the rank's time in its cause / the other ranks' median;
        under pp also `stage` (1-based) and `pipeline`: the ranks of its pipeline that
        stand out in their own stages too), or None.
    """
    found = []
    for group in _stages(ranks).values():
        hit = _find_in(group, threshold)
        if hit is not None:
            found.append((hit, group))
    if not found:
        return None
    (_, entry, cause, factor), group = max(found, key=lambda f: f[0][0])
    verdict: dict[str, Any] = {"rank": entry.get("rank"), "host": entry.get("host"),
                               "device": entry.get("device"), "factor": round(factor, 2),
                               "cause": cause}
    partners: list[dict[str, Any]] = []
    stage = stage_of(entry)
    if stage is not None:
        verdict["stage"] = stage[0] + 1
        partners = [e for (_, e, _, _), _ in found if e is not entry and _pipeline(e) == _pipeline(entry)]
        verdict["pipeline"] = sorted([entry.get("rank"), *(e.get("rank") for e in partners)],
                                     key=lambda r: (r is None, r))
    verdict["message"] = _message(entry, cause, factor, group, partners)
    return verdict


def stage_of(entry: dict[str, Any]) -> tuple[int, int] | None:
    """(stage index, stages) of a rank under pp, else None."""
    mesh = entry.get("mesh")
    pp = mesh.get("pp") if isinstance(mesh, dict) else None
    if isinstance(pp, list | tuple) and len(pp) == 2 and int(pp[1]) > 1:
        return int(pp[0]), int(pp[1])
    return None


def place_label(entry: dict[str, Any]) -> str:
    """A rank's place in its mesh, for people: "stage 2 of 2, dp 1 of 2" ("" without one)."""
    mesh = entry.get("mesh")
    if not isinstance(mesh, dict):
        return ""
    parts = []
    for dim, label in DIM_LABELS.items():
        where = mesh.get(dim)
        if isinstance(where, list | tuple) and len(where) == 2 and int(where[1]) > 1:
            parts.append(f"{label} {int(where[0]) + 1} of {int(where[1])}")
    return ", ".join(parts)


def no_verdict(ranks: list[dict[str, Any]], ended: bool = False) -> str:
    """Why nobody is named, for the views when the verdict is None (`disttrain top` while
    the run goes on; `disttrain report`, `ended`, after it)."""
    keep = "kept" if ended else "keep"
    stages = _stages(ranks)
    if len(stages) > 1 and all(len(g) < 2 for g in stages.values()):
        return ("no straggler named: each pipeline stage runs on one rank, and stages differ by "
                "design (the last runs the loss; the schedule's bubbles), so a rank is compared "
                "only with the ranks of its own stage")
    if len(stages) > 1:
        return f"no straggler: the ranks of each pipeline stage {keep} pace"
    return f"no straggler: the ranks {keep} pace"


def _stages(ranks: list[dict[str, Any]]) -> dict[int | None, list[dict[str, Any]]]:
    """The entries grouped by pipeline stage (one group, None, without pp)."""
    groups: dict[int | None, list[dict[str, Any]]] = {}
    for entry in ranks:
        stage = stage_of(entry)
        groups.setdefault(None if stage is None else stage[0], []).append(entry)
    return groups


def _pipeline(entry: dict[str, Any]) -> tuple[Any, ...]:
    """The coordinates that name a rank's pipeline: all of its mesh place but the stage."""
    mesh = entry.get("mesh") if isinstance(entry.get("mesh"), dict) else {}
    return tuple(sorted((k, tuple(v)) for k, v in mesh.items() if k != "pp"))


def _find_in(ranks: list[dict[str, Any]], threshold: float,
             ) -> tuple[float, dict[str, Any], str, float] | None:
    """The verdict among ranks that do the same work: (excess ms, entry, cause, factor)."""
    if len(ranks) < 2:
        return None
    step = median(float(e.get("step_ms") or 0.0) for e in ranks)
    if step <= 0:
        return None
    floor = MIN_SHARE * step
    best: tuple[float, dict[str, Any], str, float] | None = None   # (excess, entry, cause, factor)
    for cause in ("compute", "data"):
        best = _worst(ranks, CAUSES[cause], cause, threshold, floor, best)
    if best is not None and best[2] == "compute" and _waited_for_cpu(best[1], ranks):
        best = (best[0], best[1], "cpu share", best[3])
    if best is None:
        fast = [e for e in ranks if _load(e) >= _AS_FAST * median(_load(o) for o in ranks if o is not e)]
        best = _worst(ranks, CAUSES["communication"], "communication", threshold, floor, None, fast)
    return best


def _waited_for_cpu(entry: dict[str, Any], ranks: list[dict[str, Any]]) -> bool:
    """Whether `entry` did about the others' CPU work in compute and its extra compute time
    over their median was mostly not CPU time of its own (False where the CPU time was not
    measured, or under tp / pp)."""
    if place_label(entry):
        return False
    others = [o for o in ranks if o is not entry]
    cpu = float(entry.get(CPU_KEY) or 0.0)
    if cpu <= 0 or not all(float(o.get(CPU_KEY) or 0.0) > 0 for o in others):
        return False
    wall = float(entry.get("compute_ms") or 0.0)
    others_cpu = median(float(o[CPU_KEY]) for o in others)
    others_wall = median(float(o.get("compute_ms") or 0.0) for o in others)
    return cpu <= _SAME_WORK * others_cpu and cpu - others_cpu < _CPU_PART * (wall - others_wall)


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


def _message(entry: dict[str, Any], cause: str, factor: float, ranks: list[dict[str, Any]],
             partners: list[dict[str, Any]] | None = None) -> str:
    """`ranks`: the ones `entry` was compared with (its stage under pp)."""
    host = f"host {entry['host']}" if entry.get("host") else None
    where = ", ".join(str(v) for v in (place_label(entry) or None, host, entry.get("device"),
                                       entry.get("limit")) if v)
    who = f"rank {entry.get('rank')}" + (f" ({where})" if where else "")
    median_rank = "the median rank of its stage" if stage_of(entry) is not None else "the median rank"
    others = [o for o in ranks if o is not entry]
    wait = median(float(o.get("comm_wait_ms") or 0.0) / max(float(o.get("step_ms") or 0.0), _FLOOR_MS)
                  for o in others)
    tail = ""
    if partners:
        names = ", ".join(f"rank {p.get('rank')} ({place_label(p)})" for p in partners)
        tail = (f"; its pipeline's {names} stand{'s' if len(partners) == 1 else ''} out in "
                f"{'its' if len(partners) == 1 else 'their'} own stage too (a pipeline's stages "
                f"wait for each other inside the schedule)")
    if cause == "compute":
        what = f"it computes {factor:.1f}x longer per step than {median_rank}"
    elif cause == "cpu share":
        others_cpu = median(float(o.get(CPU_KEY) or 0.0) for o in others)
        what = (f"its compute takes {factor:.1f}x longer per step than {median_rank}'s for about "
                f"the same CPU time ({float(entry.get(CPU_KEY) or 0.0):.1f} ms against "
                f"{others_cpu:.1f} ms): it waits for a core (other processes on its cores, or "
                f"its CPU limit throttles it)")
    elif cause == "data":
        what = f"it waits {factor:.1f}x longer for its data (DataLoader) per step than {median_rank}"
    else:
        return (f"{who} is the straggler: it waits {factor:.1f}x longer in the gradient all-reduce "
                f"than {median_rank} while it computes and loads as fast: its network is the "
                f"slow part{tail}")
    # no DDP hook, no measured wait (FSDP; pp / tp's data-parallel average, timed as optimizer)
    waits = f"; the others wait for it in the all-reduce {wait:.0%} of each step" if wait > 0 else ""
    return f"{who} is the straggler: {what}{waits}{tail}"


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
