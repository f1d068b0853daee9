"""`disttrain run --task REF` and `task:` in a spec file: the reference resolved before any
process starts (a bad one exits 2 with one line and nothing written), a task trained on 2
real ranks, and a task that fails inside the workers reported once, with exit 2."""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import left_in, run_cli

pytestmark = pytest.mark.timeout(300)

TASK_FILE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from disttrain import TrainTask


    def make_task(hidden: int = 16) -> TrainTask:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = (x.sum(1) > 0).long()
        return TrainTask(model=lambda: nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
                         train_data=TensorDataset(x, y), eval_data=TensorDataset(x[:64], y[:64]),
                         loss_fn=nn.CrossEntropyLoss())


    def broken() -> TrainTask:
        raise ValueError("no training data at /data/train")


    def broken_late() -> TrainTask:
        import os
        import time
        if os.environ["RANK"] == "0":
            time.sleep(3)   # rank 1 has failed (and been seen failing) by then
        raise ValueError("no training data at /data/train")


    def not_a_task(hidden: int = 16):
        return {"model": hidden}
''')


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    (tmp_path / "mytask.py").write_text(TASK_FILE)
    return tmp_path


def _spec_of(dry_run_stdout: str) -> dict:
    return yaml.safe_load(dry_run_stdout.split("\n---\n")[0])


def test_task_flags_reach_the_resolved_spec(task_dir):
    res = run_cli("run", "--task", "mytask:make_task", "--task-args", '{"hidden": 4}',
                  "--grad-accum", "2", "--dry-run", cwd=task_dir, timeout=120)
    assert res.returncode == 0, res.stderr
    spec = _spec_of(res.stdout)
    assert spec["task"] == "mytask:make_task" and spec["task_args"] == {"hidden": 4}
    assert spec["task_dir"] == str(task_dir.resolve())  # flags: the current folder, absolute
    assert spec["train"]["grad_accum"] == 2 and "example" not in spec
    assert spec["name"] == "mytask"  # named after the task (issue 25 item 8)
    assert "-m disttrain.worker" in res.stdout.split("\n---\n")[1]


@pytest.fixture
def in_process(task_dir, monkeypatch):
    """`disttrain run --dry-run` in this process (click's runner: no new Python, no torch
    import), with sys.path and the imported task module put back afterwards."""
    from click.testing import CliRunner

    from disttrain.cli.run_cmd import run

    monkeypatch.setattr(sys, "path", list(sys.path))
    yield lambda *args, cwd=task_dir: _dry_run(CliRunner(), run, args, cwd, monkeypatch)
    sys.modules.pop("mytask", None)


def _dry_run(runner, run, args, cwd, monkeypatch) -> dict:
    monkeypatch.chdir(cwd)
    sys.modules.pop("mytask", None)
    res = runner.invoke(run, [*args, "--dry-run"])
    assert res.exit_code == 0, res.output
    return _spec_of(res.output)


def test_built_in_jobs_are_task_references_with_their_options_as_task_args(in_process):
    """`--example NAME` is short for disttrain.examples.NAME:make_task, and the example flags
    land in task_args of a task that takes them (issue 21 item 1)."""
    spec = in_process("--example", "synthetic", "--num-samples", "512", "--hidden-size", "8")
    assert spec["task"] == "disttrain.examples.synthetic:make_task" and spec["name"] == "synthetic"
    assert spec["task_args"] == {"num_samples": 512, "hidden_size": 8}
    assert not {"data_dir", "num_samples", "hidden_size", "example"} & (set(spec) | set(spec["train"]))
    default = in_process()
    assert default["task"] == "disttrain.examples.digits:make_task" and default["name"] == "disttrain"


def test_a_task_file_by_relative_or_absolute_path(task_dir, in_process):
    """`--task ../x/mytask.py:fn` and `/abs/.../mytask.py:fn`: the file's folder becomes
    task_dir (searched by every worker, shipped by k8s render) and the module its stem."""
    here = task_dir / "here"
    here.mkdir()
    for ref in ("../mytask.py:make_task", f"{task_dir}/mytask.py:make_task"):
        spec = in_process("--task", ref, cwd=here)
        assert spec["task"] == "mytask:make_task" and spec["task_dir"] == str(task_dir.resolve())
        assert spec["name"] == "mytask"


def test_spec_file_folder_is_searched_first(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "mytask.py").write_text(TASK_FILE)
    (jobs / "job.yaml").write_text("name: mine\ntask: mytask:make_task\ntask_args: {hidden: 8}\n")
    res = run_cli("run", "-f", "jobs/job.yaml", "--dry-run", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr  # found beside the spec, not in the current folder
    spec = _spec_of(res.stdout)
    assert spec["task_dir"] == str(jobs.resolve()) and spec["task_args"] == {"hidden": 8}


@pytest.mark.parametrize(("args", "needle"), [
    (("--task", "nope:make_task"), "task 'nope:make_task': no module 'nope' in "),
    (("--task", "mytask:nothing"), "module 'mytask' ("),
    (("--task", "mytask:make_task", "--task-args", "{width: 3}"),
     "task_args: mytask:make_task takes no argument width; it takes hidden"),
    (("--task", "mytask:make_task", "--task-args", "{hidden: 1, extra: 2}"),
     "takes no argument extra"),
    (("--task", "mytask:make_task", "--task-args", "{hidden: lots}"),
     "task_args: hidden: Input should be a valid integer, unable to parse string as an integer"),
    (("--task", "disttrain.examples.chargpt:make_task", "--data-dir", "/x"),
     "--data-dir: the task disttrain.examples.chargpt:make_task takes no data_dir (its arguments: "
     "block, layers"),
    (("--hidden-size", "8", "--task-args", "{hidden_size: 4}"),
     "--hidden-size: also given in --task-args; give it once"),
    (("--task", "../nowhere/mytask.py:make_task"), "no such file; give the path of an existing .py file"),
    (("--task", "mytask:make_task", "--task-args", "{hidden: .inf}"),
     "task_args: hidden: must be a finite"),
    (("--task", "mytask"), "task: write it as module:function (e.g. mytask:make_task)"),
    (("--task", "mytask:make_task", "--example", "digits"),
     "--example: give --example digits or --task mytask:make_task, not both"),
    (("--task", "mytask:make_task", "train.py"),
     "give either 'task' (a TrainTask the built-in Trainer trains)"),
    (("--task-args", "{hidden: 2}"),  # the default job is a task too: its arguments are named
     "task_args: disttrain.examples.digits:make_task takes no argument hidden; it takes hidden_size"),
    (("--task", "syntaxerr:make"), "syntaxerr.py:1: "),
    (("--task", "raises_on_import:make"), "importing 'raises_on_import' raised RuntimeError: no GPU here"),
    (("--task", "needs_missing:make"),
     "module 'needs_missing' imports 'no_such_package_x', which is not installed"),
])
def test_bad_task_exits_2_with_one_line_and_writes_nothing(task_dir, args, needle):
    (task_dir / "syntaxerr.py").write_text("def make(:\n")
    (task_dir / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (task_dir / "needs_missing.py").write_text("import no_such_package_x\n")
    earlier = task_dir / "runs" / "disttrain" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("earlier run\n")
    before = sorted(p.relative_to(task_dir) for p in task_dir.rglob("*") if "__pycache__" not in p.parts)
    res = run_cli("run", *args, "--epochs", "1", cwd=task_dir, timeout=120)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    after = sorted(p.relative_to(task_dir) for p in task_dir.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # the run dir is not touched: no job.yaml, nothing cleared
    assert earlier.read_text() == "earlier run\n"


def test_a_refused_job_leaves_no_warm_fork_server_behind(task_dir):
    """The workers' warm fork server starts before the input checks (its torch import
    overlaps the launcher's); a job they refuse stops it at once, rather than leave it
    importing torch and the task for seconds of a core after the launcher has gone."""
    import psutil

    res = run_cli("run", "--task-args", "{hidden: 2}", "--epochs", "1", cwd=task_dir, timeout=120)
    assert res.returncode == 2 and "takes no argument hidden" in res.stderr, res.stderr
    left = [p.pid for p in psutil.process_iter(["cmdline", "cwd"])
            if "multiprocessing.forkserver" in " ".join(p.info["cmdline"] or [])
            and p.info["cwd"] == str(task_dir)]
    assert left == [], "a fork server outlived the refused job"


@pytest.mark.slow
def test_task_trains_on_two_ranks(task_dir):
    # a TMPDIR too long for a unix socket (the warm worker server's): workers are spawned
    tmp = task_dir / ("t" * 100)
    tmp.mkdir()
    res = run_cli("run", "--task", "mytask:make_task", "--task-args", "{hidden: 12}",
                  "--nproc-per-node", "2", "--epochs", "1", cwd=task_dir, env={"TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "note: the warm worker server could not start (AF_UNIX path too long" in res.stderr
    # torch's agent keeps per-attempt folders; not one torchelastic_* left in TMPDIR per run
    assert left_in(tmp) == []
    run_dir = task_dir / "runs" / "mytask"   # named after the task
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params_in_sync"] is True
    assert summary["steps"] == 4  # 256 samples / (32 per rank x 2 ranks)
    job = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert job["task"] == "mytask:make_task" and job["task_dir"] == str(task_dir.resolve())
    assert job["task_args"] == {"hidden": 12}


@pytest.mark.slow
@pytest.mark.parametrize(("ref", "launcher", "message"), [
    ("mytask:broken", "torchrun",
     "error: task 'mytask:broken' raised ValueError: no training data at /data/train"),
    ("mytask:broken", "spawn",
     "error: task 'mytask:broken' raised ValueError: no training data at /data/train"),
    ("mytask:not_a_task", "torchrun",
     "error: task 'mytask:not_a_task' returned dict, not a disttrain.TrainTask"),
])
def test_task_failing_in_the_workers_is_reported_once(task_dir, ref, launcher, message):
    with tempfile.TemporaryDirectory(prefix="dt-") as tmp:   # short: the forkserver's socket
        res = run_cli("run", "--task", ref, "--nproc-per-node", "2", "--epochs", "1",
                      "--launcher", launcher, cwd=task_dir, env={"TMPDIR": tmp})
        # no worker's pytorch-errorfile-*.pickle left behind (launch/agent_scratch.py)
        left = [p.name for p in Path(tmp).iterdir() if not p.name.startswith("torchinductor")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert left == [], left
    assert res.stderr.count(message) == 1, res.stderr  # from rank 0's record, not once per rank
    # the factory's own frames may be shown (inside the message); disttrain's and torch's not
    assert "disttrain/worker.py" not in res.stderr and "site-packages/torch" not in res.stderr, res.stderr
    assert "the job failed" not in res.stderr
    # the kind travelled typed: each rank's record in the run dir (errors.Failure)
    records = [json.loads(p.read_text()) for p in task_dir.glob("runs/*/failures/rank-*.json")]
    # one record per rank that ended on its own; under torchrun the agent SIGTERMs the
    # other rank as soon as one failed, which can be before it reached the factory (once
    # in 60 runs beside 3 busy processes); --launcher spawn waits PEER_EXIT_GRACE_S first
    ranks = sorted(r["rank"] for r in records)
    assert ranks == [0, 1] or (launcher == "torchrun" and len(ranks) == 1), records
    kinds = {r["rank"]: (r["kind"], r["error"]) for r in records}
    # every rank raises in the factory; a rank still inside a collective when its peer
    # left with the error records that as a crash of its own (seen under load, -n 3)
    assert ("task", "TaskError") in kinds.values(), records
    assert set(kinds.values()) <= {("task", "TaskError"), ("crash", "RuntimeError")}, records
    task_records = [r for r in records if r["kind"] == "task"]
    assert all(message.removeprefix("error: ") in r["message"] for r in task_records)


@pytest.mark.slow
def test_spawn_gives_a_peer_time_to_record_its_own_failure(task_dir):
    """Fault: rank 1 raises at once, rank 0 the same error 3 s later. torch's join SIGTERMs
    the other workers as soon as one failed; `--launcher spawn` gives them
    PEER_EXIT_GRACE_S first, so rank 0's own typed record is written too."""
    tmp = task_dir / "tmp"
    tmp.mkdir()
    res = run_cli("run", "--task", "mytask:broken_late", "--nproc-per-node", "2", "--epochs", "1",
                  "--launcher", "spawn", cwd=task_dir, env={"TMPDIR": str(tmp)})
    assert res.returncode == 2, res.stderr[-3000:]
    # torch's join reads the failed workers' pytorch-errorfile-*.pickle and leaves them
    assert left_in(tmp) == []
    records = [json.loads(p.read_text()) for p in task_dir.glob("runs/*/failures/rank-*.json")]
    assert sorted((r["rank"], r["kind"]) for r in records) == [(0, "task"), (1, "task")], records


def test_worker_reports_a_task_error_with_exit_2(task_dir):
    """`python -m disttrain.worker` (what a pod runs): one rank, a hand-written spec whose
    folder holds the task's module, run from another folder."""
    import subprocess

    (task_dir / "job.yaml").write_text("task: mytask:broken\ntrain: {epochs: 1}\n")
    other = task_dir / "elsewhere"
    other.mkdir()
    res = subprocess.run([sys.executable, "-m", "disttrain.worker", "--spec", str(task_dir / "job.yaml")],
                         cwd=other, capture_output=True, text=True, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.startswith("error: task 'mytask:broken' raised ValueError: no training data")
    assert "disttrain/worker.py" not in res.stderr
