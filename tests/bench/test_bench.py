"""`disttrain bench`: the JSON outputs parse and hold the documented fields, busbw is
consistent with algbw and the world size, results land in the run directory. Tiny
settings, no timing assertions."""

from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner

from disttrain.bench import training
from disttrain.bench.allreduce import FIELDS, busbw_factor
from disttrain.bench.common import parse_size, parse_sizes
from disttrain.cli.bench_cmd import bench

pytestmark = pytest.mark.timeout(150)
TINY = ["--steps", "10", "--warmup", "10", "--rounds", "1", "--num-samples", "512", "--json"]


def _json_lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_sizes_follow_nccl_tests_conventions():
    assert parse_size("4K") == 4096 and parse_size("256M") == 256 << 20 and parse_size("12") == 12
    sweep = parse_sizes("4K:256M")
    assert sweep[0] == 4096 and sweep[-1] == 256 << 20 and len(sweep) == 17
    assert all(b == 2 * a for a, b in itertools.pairwise(sweep))
    assert parse_sizes("1M,16M,64M") == [1 << 20, 16 << 20, 64 << 20]
    for bad in ("4X", "8M:4M", "", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    assert busbw_factor(1) == 0 and busbw_factor(2) == 1 and busbw_factor(8) == 1.75


def test_allreduce_json_fields_busbw_and_run_dir(tmp_path):
    res = CliRunner().invoke(bench, [
        "allreduce", "--sizes", "4K,64K", "--iters", "3", "--warmup", "1", "--json",
        "--nproc-per-node", "2", "--backend", "gloo", "--master-port", "0", "--timeout-s", "60",
        "--run-dir", str(tmp_path / "ar"), "--plot", str(tmp_path / "ar.png")])
    assert res.exit_code == 0, res.output
    rows = _json_lines(res.output)
    assert [r["size_bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert tuple(r) == FIELDS
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["time_s"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    saved = json.loads((tmp_path / "ar" / "results.json").read_text())
    assert saved["kind"] == "allreduce" and saved["rows"] == rows
    assert saved["settings"]["iters"] == 3 and "torch" in saved["environment"]
    assert len((tmp_path / "ar" / "results.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "ar" / "allreduce.png").stat().st_size > 1000
    assert (tmp_path / "ar.png").stat().st_size > 1000


def test_allreduce_bad_sizes_exit_2():
    res = CliRunner().invoke(bench, ["allreduce", "--sizes", "lots"])
    assert res.exit_code == 2 and "error: --sizes" in res.output


def test_window_throughput_reads_rank0_intervals(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"split": "train", "rank": rank, "step": step, "samples_per_s": rate}
            for rank in (0, 1) for step, rate in ((10, 1.0), (20, 100.0), (30, 200.0))]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # steps 11..30: 20 steps x 8 samples; 80 samples at 100/s + 80 at 200/s = 1.2 s
    assert training.window_throughput(metrics, 10, 20, 8) == pytest.approx(160 / 1.2)
    with pytest.raises(training.BenchError, match="no records up to step 40"):
        training.window_throughput(metrics, 10, 30, 8)


def test_scaling_summary_is_paired_by_round(tmp_path, monkeypatch):
    thr = {(0, 1): 100.0, (0, 2): 150.0, (1, 1): 80.0, (1, 2): 160.0}
    seen = iter([(0, 1), (0, 2), (1, 2), (1, 1)])  # odd rounds run in reverse order

    def fake(b, n, run_dir):
        rnd, nproc = next(seen)
        assert nproc == n
        return {"samples_per_s": thr[(rnd, n)], "first_step_s": 1.0}

    monkeypatch.setattr(training, "run_trainer", fake)
    rows, summary = training.run_scaling(training.TrainBench(), 2, 2, tmp_path)
    assert [(r["round"], r["nproc"]) for r in rows] == [(0, 1), (0, 2), (1, 2), (1, 1)]
    two = summary[1]
    assert two["nproc"] == 2 and two["samples_per_s"] == 155.0
    assert two["efficiency"] == pytest.approx(155.0 / (2 * 90.0))
    assert two["efficiency_min"] == pytest.approx(0.75) and two["efficiency_max"] == pytest.approx(1.0)
    assert summary[0]["efficiency"] == pytest.approx(1.0)


def test_scaling_json_shape(tmp_path):
    res = CliRunner().invoke(bench, ["scaling", "--max-procs", "1", *TINY,
                                     "--run-dir", str(tmp_path / "sc")])
    assert res.exit_code == 0, res.output
    (row,) = _json_lines(res.output)
    assert row["nproc"] == 1 and row["workload"] == "synthetic" and row["samples_per_s"] > 0
    assert row["efficiency"] == pytest.approx(1.0)
    saved = json.loads((tmp_path / "sc" / "results.json").read_text())
    assert saved["summary"] == [row] and saved["rows"][0]["params_in_sync"] is True
    assert saved["rows"][0]["first_step_s"] > 0
    assert (tmp_path / "sc" / "scaling.png").exists()


def test_overhead_json_shape(tmp_path):
    res = CliRunner().invoke(bench, ["overhead", *TINY, "--run-dir", str(tmp_path / "ov")])
    assert res.exit_code == 0, res.output
    objs = _json_lines(res.output)
    row, summary = objs[0], objs[-1]["summary"]
    assert row["ratio"] == pytest.approx(row["trainer_samples_per_s"] / row["plain_samples_per_s"])
    assert row["trainer_params_in_sync"] is True and row["plain_params_in_sync"] is True
    assert row["trainer_first_step_s"] > 0 and row["plain_first_step_s"] > 0
    assert summary["ratio_median"] == summary["ratio_min"] == summary["ratio_max"] == row["ratio"]
    plain = json.loads((tmp_path / "ov" / "runs" / "plain-r0.json").read_text())
    assert plain["steps"] == 10 and plain["warmup"] == 10 and plain["world_size"] == 2
    assert (tmp_path / "ov" / "overhead.png").exists()


def test_overhead_without_plain_script_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(bench, ["overhead", "--plain-script", str(tmp_path / "none.py")])
    assert res.exit_code == 2 and "--plain-script" in res.output
    assert not (tmp_path / "runs").exists(), "nothing may be written on bad input"
