"""Run dirs written to the issue-17 schema (docs/monitoring.md), for the readers' tests.

`schema_run(tmp_path, world=4, slow=1)` writes what a finished 4-rank run with a slow rank 1
leaves: metrics.jsonl train rows with the step-time columns, summary.json with `ranks` and
`straggler`, and live/rank-<R>.json (+ straggler.json). The real Trainer's files are read
in test_real_run.py; these cover the shapes a real CPU run cannot produce (a straggler).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

PARTS = ("data_ms", "compute_ms", "comm_wait_ms", "optimizer_ms", "other_ms")


def _timing(rank: int, slow: int | None) -> dict[str, float]:
    compute = 30.0 * (2.8 if rank == slow else 1.0)
    comm = 4.0 if rank == slow else 4.0 + 54.0   # the others wait for the slow one
    t = {"data_ms": 2.0 + rank * 0.1, "compute_ms": compute, "comm_wait_ms": comm,
         "optimizer_ms": 3.0, "other_ms": 1.5}
    t["step_ms"] = round(sum(t.values()), 3)
    return t


def write_schema_run(run_dir: Path, world: int = 4, slow: int | None = 1, steps: int = 40,
                     finished: bool = True, done: bool | None = None,
                     now: float | None = None) -> dict[str, Any]:
    """Write the run dir; returns the summary it wrote (or would write)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(5, steps + 1, 5):
        for rank in range(world):
            sps = 400.0 * (0.36 if slow is not None else 1.0) + rank
            rows.append({"split": "train", "rank": rank, "epoch": 0, "step": step,
                         "loss": 2.3 / (1 + 0.05 * step) + 0.01 * rank, "lr": 0.01,
                         "samples_per_s": sps, **_timing(rank, slow)})
    rows.append({"split": "eval", "rank": -1, "epoch": 0, "step": steps, "loss": 0.4,
                 "accuracy": 0.91})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ranks = [{"rank": r, "host": f"job-{r // 2}", "device": f"cuda:{r % 2}",
              "samples_per_s": 400.0 * (0.36 if slow is not None else 1.0) + r, **_timing(r, slow)}
             for r in range(world)]
    straggler = None
    if slow is not None:
        straggler = {"rank": slow, "host": f"job-{slow // 2}", "device": f"cuda:{slow % 2}",
                     "factor": 2.8, "cause": "compute",
                     "message": f"rank {slow} (host job-{slow // 2}, cuda:{slow % 2}) is the "
                                "straggler: it computes 2.8x longer per step than the median rank; "
                                "the others wait for it in the all-reduce 64% of each step"}
    summary = {"world_size": world, "strategy": "ddp", "backend": "nccl", "epochs": 1,
               "steps": steps, "final_loss": 0.7123456, "test_loss": 0.4, "test_accuracy": 0.91,
               "samples_per_s": 1234.5678, "wall_s": 12.345, "params_in_sync": True,
               "ranks": ranks, "straggler": straggler}
    if finished:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    live = run_dir / "live"
    live.mkdir(exist_ok=True)
    t = time.time() if now is None else now
    for r in ranks:
        rec = {"rank": r["rank"], "world_size": world, "host": r["host"], "pid": 1000 + r["rank"],
               "device": r["device"], "epoch": 0, "step": steps, "loss": 0.7 + 0.01 * r["rank"],
               "samples_per_s": r["samples_per_s"], **{k: r[k] for k in ("step_ms", *PARTS)},
               "time": t - r["rank"], "done": finished if done is None else done}
        (live / f"rank-{r['rank']}.json").write_text(json.dumps(rec))
    if straggler:
        (live / "straggler.json").write_text(json.dumps(straggler))
    return summary


@pytest.fixture
def schema_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "job"
    write_schema_run(run_dir)
    return run_dir
