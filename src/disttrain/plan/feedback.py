"""What a finished run really used against what it asked for, and the slice for next time.

    fb = memory_feedback(summary, run_dir)      # None when the run measured nothing
    fb["next_gpumem_mib"], fb["requested_gpumem"], fb["ranks"]

Each rank's figures come from summary.json's `ranks` (`train/memory.py`): on CUDA the
slice use as HAMi counts it (`mem_get_info` total - free) and the caching allocator's
peak reserved; on the CPU the tracked tensor peak of the first two steps, turned into a
request by the plan's own formula (plan/slice.py), so the plumbing is the same.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from disttrain.plan.slice import MIB, ROUND_MIB, slice_request

# The next request is the measured peak plus this share, rounded up: the steps measured may
# miss a later, larger one (an evaluation batch, a checkpoint's gathered state).
NEXT_HEADROOM = 1.10


def memory_feedback(summary: dict[str, Any], run_dir: Path | None = None) -> dict[str, Any] | None:
    """The run's measured memory per rank, the slice it asked for, the one to ask next."""
    ranks = [r for r in summary.get("ranks") or [] if r.get("memory_source") in ("cuda", "tracker")]
    if not ranks:
        return None
    source = ranks[0]["memory_source"]
    rows = [{"rank": r.get("rank"), "tensor_peak_mib": round((r.get("tensor_peak_bytes") or 0) / MIB, 1),
             "peak_reserved_mib": r.get("peak_reserved_mib"),
             "slice_used_mib": r.get("slice_used_mib")} for r in ranks]
    world = int(summary.get("world_size") or len(ranks))
    if source == "cuda":
        used = max(float(r.get("slice_used_mib") or r.get("peak_reserved_mib") or 0) for r in ranks)
        nxt = int(math.ceil(used * NEXT_HEADROOM / ROUND_MIB) * ROUND_MIB)
    else:
        peak = max(int(r.get("tensor_peak_bytes") or 0) for r in ranks)
        used = peak / MIB
        nxt = slice_request(peak, 1, world).gpumem_mib
    return {"source": source, "measured_mib": round(used, 1), "next_gpumem_mib": nxt,
            "requested_gpumem": requested_gpumem(run_dir), "ranks": rows}


def requested_gpumem(run_dir: Path | None) -> int | None:
    """The slice the run's job.yaml asked for (MiB per GPU), when it names one."""
    if run_dir is None:
        return None
    import yaml

    from disttrain.rundir import JOB_YAML

    try:
        data = yaml.safe_load((Path(run_dir) / JOB_YAML).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    value = (data.get("cluster") or {}).get("gpumem") if isinstance(data, dict) else None
    return value if isinstance(value, int) else None


def feedback_lines(fb: dict[str, Any]) -> list[str]:
    """The feedback as the lines `disttrain report` prints under its tables."""
    what = ("slice use (HAMi's count: mem_get_info total - free)" if fb["source"] == "cuda"
            else "tracked tensor peak of the first two steps (CPU run)")
    per_rank = ", ".join(f"rank {r['rank']} {r['slice_used_mib']} MiB" for r in fb["ranks"])
    lines = [f"memory: {what}: {per_rank}"]
    asked = fb["requested_gpumem"]
    head = f"gpumem for next time: {fb['next_gpumem_mib']} MiB per GPU"
    if asked is not None:
        head += f" (this run asked for {asked} MiB; measured {fb['measured_mib']:,.0f} MiB)"
    return [*lines, head]
