"""`disttrain bench`: the JSON outputs parse and hold the documented fields, busbw is
consistent with algbw and the world size, results land in the run directory. Tiny
settings, no timing assertions."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from disttrain.bench import training
from disttrain.bench.allreduce import FIELDS, busbw_factor
from disttrain.bench.common import parse_size, parse_sizes
from disttrain.cli.bench_cmd import bench
from tests.conftest import left_in

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
    assert "plain_efficiency" not in two
    # batch 64 per process: 1 process 64 / 90 samples/s, 2 processes 128 / 155
    assert summary[0]["step_ms"] == pytest.approx(1e3 * 64 / 90.0)
    assert summary[0]["added_step_ms"] == pytest.approx(0.0)
    assert two["step_ms"] == pytest.approx(1e3 * 128 / 155.0)
    assert two["added_step_ms"] == pytest.approx(1e3 * (128 / 155.0 - 64 / 90.0))


def test_scaling_runs_the_plain_loop_beside_in_the_same_rounds(tmp_path, monkeypatch):
    order = []

    def fake(side, rate):
        def run(b, n, *args, **kwargs):
            order.append((side, n))
            return {"samples_per_s": rate * (1.5 if n == 2 else 1.0)}
        return run

    monkeypatch.setattr(training, "run_trainer", fake("trainer", 100.0))
    monkeypatch.setattr(training, "run_plain", fake("plain", 80.0))
    rows, summary = training.run_scaling(training.TrainBench(), 2, 2, tmp_path,
                                         plain_script=tmp_path / "plain_ddp.py")
    assert order == [("trainer", 1), ("plain", 1), ("trainer", 2), ("plain", 2),
                     ("plain", 2), ("trainer", 2), ("plain", 1), ("trainer", 1)]
    assert {r["side"] for r in rows} == {"trainer", "plain"}
    two = summary[1]
    assert two["samples_per_s"] == 150.0 and two["plain_samples_per_s"] == 120.0
    assert two["efficiency"] == two["plain_efficiency"] == pytest.approx(0.75)
    # the same efficiency, but the plain loop's slower single process: more time added
    assert two["added_step_ms"] == pytest.approx(1e3 * (128 / 150.0 - 64 / 100.0))
    assert two["plain_added_step_ms"] == pytest.approx(1e3 * (128 / 120.0 - 64 / 80.0))


def test_scaling_table_shows_what_the_second_process_adds(tmp_path, monkeypatch):
    def fake(rate):
        def run(b, n, *args, **kwargs):
            return {"samples_per_s": rate * (1.5 if n == 2 else 1.0)}
        return run

    monkeypatch.setattr(training, "run_trainer", fake(32_000.0))
    monkeypatch.setattr(training, "run_plain", fake(16_000.0))
    res = CliRunner().invoke(bench, ["scaling", "--max-procs", "2", "--rounds", "1",
                                     "--run-dir", str(tmp_path / "sc")])
    assert res.exit_code == 0, res.output
    one, two = (ln.split() for ln in res.output.splitlines() if ln.split()[:1] in (["1"], ["2"]))
    # 1 process: 64 samples at 32,000/s = 2.00 ms, plain 4.00; 2: 128 at 48,000/s = 2.67 ms
    assert one[4] == "2.00" and one[-1] == "4.00"
    assert two[4:6] == ["2.67", "+0.67"] and two[-2:] == ["5.33", "+1.33"]


def test_scaling_json_shape(tmp_path, private_tmpdir):
    # both sides' torchrun leave nothing in the temp folder
    res = CliRunner().invoke(bench, ["scaling", "--max-procs", "1", *TINY,
                                     "--run-dir", str(tmp_path / "sc")])
    assert res.exit_code == 0, res.output
    assert left_in(private_tmpdir) == []
    (row,) = _json_lines(res.output)
    assert row["nproc"] == 1 and row["workload"] == "synthetic" and row["samples_per_s"] > 0
    assert row["efficiency"] == pytest.approx(1.0) == row["plain_efficiency"]
    assert row["plain_samples_per_s"] > 0
    saved = json.loads((tmp_path / "sc" / "results.json").read_text())
    assert saved["summary"] == [row] and saved["rows"][0]["params_in_sync"] is True
    assert saved["rows"][0]["first_step_s"] > 0
    assert saved["settings"]["contend"] == 0 and saved["settings"]["plain_script"].endswith("plain_ddp.py")
    assert (tmp_path / "sc" / "scaling.png").exists()


def test_contend_busies_the_cores_for_the_whole_benchmark_only(tmp_path, monkeypatch):
    import psutil

    seen: list[int] = []

    def fake(b, script, rounds, out, **kw):
        busy = [c for c in psutil.Process().children() if "getppid" in " ".join(c.cmdline())]
        seen.extend(c.pid for c in busy)
        assert all(c.status() != psutil.STATUS_ZOMBIE for c in busy)
        row = {"round": 0, "ratio": 1.0, "trainer_samples_per_s": 1.0, "plain_samples_per_s": 1.0}
        return [row], {"ratio_median": 1.0}

    monkeypatch.setattr(training, "run_overhead", fake)
    res = CliRunner().invoke(bench, ["overhead", "--contend", "2", "--json",
                                     "--run-dir", str(tmp_path / "ov")])
    assert res.exit_code == 0, res.output
    assert len(seen) == 2, "two busy processes while the benchmark ran"
    assert _json_lines(res.output)[-1]["summary"]["contend"] == 2
    assert json.loads((tmp_path / "ov" / "results.json").read_text())["settings"]["contend"] == 2
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in seen), "stopped when the benchmark ended"


def test_overhead_without_plain_script_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(bench, ["overhead", "--plain-script", str(tmp_path / "none.py")])
    assert res.exit_code == 2 and "--plain-script" in res.output
    assert not (tmp_path / "runs").exists(), "nothing may be written on bad input"


# -- chargpt and --task: a TrainTask beside benchmarks/plain_chargpt.py ---------------------
@pytest.mark.parametrize("verb, args, says", [
    ("overhead", ["--example", "chargpt", "--task", "t:make_task"], "--task: give --example chargpt"),
    ("scaling", ["--task-args", "{}"], "--task-args"),
    ("overhead", ["--task", "disttrain.examples.chargpt:make_task", "--task-args", "{x"], "not JSON"),
    ("overhead", ["--task", "disttrain.examples.chargpt:make_task", "--task-args", "[1]"],
     "a JSON object"),
    ("scaling", ["--task", "no_such_task_module:make_task"], "no module 'no_such_task_module'"),
    ("overhead", ["--task", "disttrain.examples.chargpt:no_such_fn"], "has no 'no_such_fn'"),
    ("overhead", ["--task", "not a reference"], "module:function"),
    ("overhead", ["--example", "chargpt", "--plain-loader", "index"], "--plain-loader index"),
    ("scaling", ["--example", "chargpt", "--num-samples", "512"], "--num-samples"),
    ("overhead", ["--task", "disttrain.examples.chargpt:make_task", "--num-samples", "512"],
     "--num-samples"),
    ("overhead", ["--example", "digits"], "--example"),
])
def test_bad_workload_combinations_exit_2_and_write_nothing(tmp_path, monkeypatch, verb, args, says):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(bench, [verb, *args])
    assert res.exit_code == 2, res.output
    assert says in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "runs").exists(), "nothing may be written on bad input"


def test_both_sides_get_the_same_task_window_and_optimizer(tmp_path):
    b = training.TrainBench(workload="task", task="mytask:make_task", task_args={"hidden": 8},
                            steps=30, warmup=10, batch_size=16)
    trainer = training.trainer_argv(b, 2, tmp_path / "t")
    plain = training.plain_argv(b, 2, tmp_path / "plain_chargpt.py", tmp_path / "p.json", "dataloader")

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(trainer, "--task") == flag(plain, "--task") == "mytask:make_task"
    assert json.loads(flag(trainer, "--task-args")) == json.loads(flag(plain, "--task-args")) == {"hidden": 8}
    assert "--example" not in trainer and "--loader" not in plain
    assert flag(trainer, "--max-steps") == "40"
    assert (flag(plain, "--steps"), flag(plain, "--warmup")) == ("30", "10")
    assert flag(trainer, "--lr") == flag(plain, "--lr") == "0.001" and flag(trainer, "--lr-scaling") == "none"
    assert flag(trainer, "--optimizer") == flag(plain, "--optimizer") == "adam"
    assert flag(trainer, "--log-every-steps") == flag(plain, "--log-every") == "10"
    assert flag(trainer, "--batch-size") == flag(plain, "--batch-size") == "16"
    chargpt = training.TrainBench(workload="chargpt")
    assert training.trainer_argv(chargpt, 1, tmp_path)[4:6] == ["--example", "chargpt"]
    assert chargpt.task_ref == "disttrain.examples.chargpt:make_task"
    assert chargpt.plain_script_name == "plain_chargpt.py"
    assert training.TrainBench().plain_script_name == "plain_ddp.py"
    assert training.TrainBench().task_ref is None


def test_train_curve_averages_the_ranks(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"split": "train", "rank": 0, "step": 10, "loss": 2.0},
            {"split": "train", "rank": 1, "step": 10, "loss": 3.0},
            {"split": "eval", "rank": -1, "step": 10, "loss": 9.0},
            {"split": "train", "rank": 0, "step": 20, "loss": 1.0},
            {"split": "train", "rank": 1, "step": 20, "loss": 1.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert training.train_curve(metrics) == [[10, 2.5], [20, 1.25]]


def test_curves_agree_on_their_later_half_level():
    plain = [[s, 4.0 - s / 100] for s in range(10, 110, 10)]
    same = [[s, v + (0.01 if s % 20 else -0.01)] for s, v in plain]   # rounding-level wiggle
    got = training.compare_curves(same, plain, warmup=10)
    assert got["agree"] is True and got["points"] == 9
    assert got["max_gap"] == pytest.approx(0.01)
    higher = [[s, v * 1.05] for s, v in plain]                           # 5 % worse: a real gap
    got = training.compare_curves(higher, plain, warmup=10)
    assert got["agree"] is False and got["late_gap"] > 0
    # only the steps both logged after the warm-up count
    assert training.compare_curves([[5, 1.0]], [[5, 1.0]], warmup=10)["agree"] is None


# One `bench overhead` run (2 processes each side, 10 + 10 steps) that the tests below all
# read: starting a Trainer and a plain loop is what costs, not the steps. The workload is a
# user's task in the current folder (found there by both sides, as `disttrain run --task`)
# that builds a small chargpt (a real transformer with held-out data) with its own loss_fn,
# so one run shows a task's options, its loss_fn and a real model on both sides.
# `--example chargpt` resolving to the same plain loop and task: test_both_sides_... above.
TASK_MODULE = '''
from dataclasses import replace

from torch import nn
from disttrain.examples.chargpt import make_task as chargpt_task


def tokens_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def make_task(width: int = 16):
    task = chargpt_task(block=16, layers=1, width=width, heads=2, stride=64)
    return replace(task, loss_fn=tokens_loss, name="t_bench_task")
'''


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(its run dir, its output) of `bench overhead --task t_bench_task:make_task`."""
    cwd = tmp_path_factory.mktemp("overhead")
    (cwd / "t_bench_task.py").write_text(TASK_MODULE)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)  # the task is found in the current folder, as `disttrain run --task`
        mp.syspath_prepend(str(cwd))
        res = CliRunner().invoke(bench, ["overhead", "--task", "t_bench_task:make_task", "--task-args",
                                         '{"width": 32}', "--steps", "10", "--warmup", "10",
                                         "--rounds", "1", "--json", "--run-dir", str(cwd / "ov")])
    assert res.exit_code == 0, res.output
    return cwd / "ov", res.output


@pytest.mark.slow
def test_overhead_json_shape(overhead_run):
    run_dir, output = overhead_run
    objs = _json_lines(output)
    row, summary = objs[0], objs[-1]["summary"]
    assert row["ratio"] == pytest.approx(row["trainer_samples_per_s"] / row["plain_samples_per_s"])
    assert row["trainer_params_in_sync"] is True and row["plain_params_in_sync"] is True
    assert row["trainer_first_step_s"] > 0 and row["plain_first_step_s"] > 0
    assert summary["ratio_median"] == summary["ratio_min"] == summary["ratio_max"] == row["ratio"]
    plain = json.loads((run_dir / "runs" / "plain-r0.json").read_text())
    assert plain["steps"] == 10 and plain["warmup"] == 10 and plain["world_size"] == 2
    assert (run_dir / "overhead.png").exists()


@pytest.mark.slow
def test_overhead_of_a_user_task_runs_its_loss_fn_on_both_sides(overhead_run):
    run_dir, output = overhead_run
    row, summary = _json_lines(output)[0], _json_lines(output)[-1]["summary"]
    # the same batches from the same weights: the curves are the same up to float rounding
    assert row["curve_points"] == 1 and row["curves_agree"] is True
    assert row["curve_max_gap"] < 1e-3
    assert row["trainer_eval_loss"] == pytest.approx(row["plain_eval_loss"], abs=1e-3)
    assert summary["workload"] == "t_bench_task:make_task" and summary["curves_agree"] is True
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["settings"]["task_args"] == {"width": 32}
    assert saved["settings"]["plain_script"].endswith("plain_chargpt.py")
    plain = json.loads((run_dir / "runs" / "plain-r0.json").read_text())
    assert plain["task"] == "t_bench_task:make_task"
    assert [s for s, _ in plain["loss_curve"]] == [10, 20]


def test_contention_runs_busy_processes_only_for_the_block():
    import psutil

    from disttrain.bench.contend import contention

    with contention(2, limit_s=60) as pids:
        assert len(pids) == 2
        procs = [psutil.Process(pid) for pid in pids]
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
        assert procs[0].cpu_affinity() == psutil.Process().cpu_affinity()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)
    with contention(0) as none:
        assert none == []


def test_a_busy_process_ends_by_itself_at_its_limit():
    import psutil

    from disttrain.bench.contend import contention

    with contention(1, limit_s=0.5) as (pid,):
        psutil.Process(pid).wait(timeout=30)   # returns: it ended by itself
