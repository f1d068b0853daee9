"""Measured, fed back: a run records each rank's memory in summary.json's `ranks` and its
live file (on the CPU the tracked tensor peak of the first two steps, the figure the plan
predicts), and `disttrain report` shows it with the gpumem to ask for next time."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.plan.feedback import feedback_lines, memory_feedback
from disttrain.plan.trace import Knobs
from disttrain.plan.tracing import trace_memory
from disttrain.spec.job import JobSpec
from disttrain.testing import setup_for_test
from disttrain.train.build import build_trainer
from tests.plan.tasks import dict_task


def test_a_cpu_run_records_the_tracked_peak_and_report_feeds_it_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spec = JobSpec.from_dict({}, {"epochs": 1, "max_steps": 4, "batch_size": 64,
                                  "log_every_steps": 1, "checkpoint_every_epochs": 0,
                                  "strategy": "none", "run_dir": str(run_dir)})
    with setup_for_test() as rt:
        summary = build_trainer(spec, rt, dict_task()).fit()
    mine = summary["ranks"][0]
    assert mine["memory_source"] == "tracker"
    assert mine["slice_used_mib"] == mine["peak_reserved_mib"] > 0
    planned = trace_memory(dict_task(), Knobs(strategy="none", batch_size=64)).peak_bytes
    assert abs(mine["tensor_peak_bytes"] / planned - 1) < 0.10, (mine, planned)
    live = json.loads(next((run_dir / "live").glob("rank-*.json")).read_text())
    assert live["slice_used_mib"] == mine["slice_used_mib"]

    written = json.loads((run_dir / "summary.json").read_text())
    fb = memory_feedback(written, run_dir)
    assert fb is not None and fb["source"] == "tracker"
    assert fb["next_gpumem_mib"] >= 512 and fb["ranks"][0]["rank"] == 0
    assert any("gpumem for next time" in line for line in feedback_lines(fb))


def test_feedback_on_cuda_takes_hamis_count_with_headroom() -> None:
    summary = {"world_size": 2, "ranks": [
        {"rank": 0, "memory_source": "cuda", "tensor_peak_bytes": 9 * 2**30,
         "peak_reserved_mib": 9800.0, "slice_used_mib": 10500.0},
        {"rank": 1, "memory_source": "cuda", "tensor_peak_bytes": 9 * 2**30,
         "peak_reserved_mib": 9700.0, "slice_used_mib": 10400.0}]}
    fb = memory_feedback(summary)
    assert fb is not None and fb["measured_mib"] == 10500.0
    assert fb["next_gpumem_mib"] == 11776   # 10500 x 1.1 = 11550, rounded up to 256 MiB
    assert memory_feedback({"ranks": [{"rank": 0}]}) is None
