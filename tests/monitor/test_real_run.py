"""top, report and TensorBoard over the files a real `disttrain run` (2 gloo ranks) writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import run_cli, start_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_top_follows_a_real_run_to_its_end_then_report_and_tensorboard(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    log = tmp_path / "job.log"
    job = start_cli("run", "--max-steps", "8", "--log-every-steps", "2", "--master-port", "0",
                    "--run-dir", str(run_dir), cwd=tmp_path, log=log)
    try:   # started beside the job: it waits for the first live file, then follows to the end
        top = run_cli("top", str(run_dir), "--timeout", "180", "--interval", "0.5", "--stale",
                      "120", cwd=tmp_path, timeout=300)
        job.wait(240)
    finally:
        job.kill()
    out = log.read_text()
    assert job.returncode == 0, out[-3000:]
    assert top.returncode == 0, (top.stdout + top.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "finished" in top.stdout
    rows = [line.split() for line in top.stdout.splitlines()   # each rank's live file, read
            if line.split() and line.split()[0] in ("0", "1") and line.split()[2] == "cpu"]
    assert {r[0] for r in rows} == {"0", "1"} and all(r[3] == "8" for r in rows[-2:]), top.stdout

    rep = run_cli("report", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert rep.returncode == 0, rep.stderr
    got = json.loads(rep.stdout)
    assert (run_dir / "report.png").stat().st_size > 20_000
    assert got["final_loss"] == summary["final_loss"] and got["steps"] == summary["steps"] == 8
    assert got["ranks"] == summary["ranks"] and [r["rank"] for r in got["ranks"]] == [0, 1]
    assert all(r["step_ms"] > 0 and r["compute_ms"] > 0 for r in got["ranks"])

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        want = [(r["step"], r["loss"]) for r in rows if r["split"] == "train" and r["rank"] == rank]
        assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars(f"loss/rank{rank}")] == want
    assert {"eval/accuracy", "lr", "step_ms/compute/rank1", "samples_per_s/rank0"} <= set(
        acc.Tags()["scalars"])
