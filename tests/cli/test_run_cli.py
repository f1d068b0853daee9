"""`disttrain run` end to end, as a user runs it (subprocesses, real torchrun, gloo)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import DIGITS_JOB, REFERENCE_JOB, REFERENCE_STEPS, ROOT, WITH_LOSS_PNG, copy_run, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_main_job_defaults(tmp_path):
    res = run_cli("run", cwd=tmp_path, env=WITH_LOSS_PNG)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "epoch  train loss  test loss  test acc   samples/s" in out
    assert "parameters identical on all 2 ranks: yes" in out
    run_dir = tmp_path / "runs" / "disttrain"
    summary = _summary(run_dir)
    assert summary["test_accuracy"] >= 0.95
    assert summary["params_in_sync"] is True and summary["world_size"] == 2
    assert summary["epochs"] == 10 and summary["backend"] == "gloo"
    for key in ("steps", "final_loss", "samples_per_s", "params_sha256", "wall_s",
                "torch_version", "global_batch", "lr_effective", "allreduce_bytes_per_step"):
        assert key in summary, key
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records if r["split"] == "train"} == {0, 1}
    assert sum(r["split"] == "eval" for r in records) == 10
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "last.pt").exists()
    assert "name: disttrain" in (run_dir / "job.yaml").read_text()
    # what `make run` prints: the banner names the task, the last line the run dir
    banner = "disttrain: digits | strategy ddp | backend gloo | world size 2 | device cpu"
    assert out.splitlines()[0] == banner
    assert out.rstrip().endswith("| run dir runs/disttrain")
    assert summary["data_preloaded"] is True  # the warm fork server ran the task's warm hook


def test_the_default_job_is_its_task_reference_bit_for_bit(tmp_path, digits_reference):
    """`disttrain run` is short for `--task disttrain.examples.digits:make_task` (issue 21
    item 1): the long form trains the same parameters, bit for bit, with the same losses, as
    the session's reference run of the short form (one topology: 1 host x 2 processes)."""
    res = run_cli(*REFERENCE_JOB, "--task", "disttrain.examples.digits:make_task", "--run-dir",
                  "long", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("disttrain: digits | strategy ddp")
    short, long = _summary(digits_reference), _summary(tmp_path / "long")
    assert short["params_sha256"] == long["params_sha256"] and short["steps"] == REFERENCE_STEPS

    def losses(run_dir: Path) -> list[tuple]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["split"], r["rank"], r.get("step"), r.get("loss"), r.get("accuracy")) for r in rows]

    assert losses(digits_reference) == losses(tmp_path / "long")


def test_resume_is_bitwise_identical(tmp_path, digits_reference):
    """1 epoch, then resumed with --epochs 2: the same parameters as 2 epochs at once (the
    session's reference run, conftest.py)."""
    part = run_cli(*DIGITS_JOB, "--epochs", "1", "--run-dir", "part", cwd=tmp_path)
    assert part.returncode == 0, part.stderr[-2000:]
    rest = run_cli(*DIGITS_JOB, "--epochs", "2", "--run-dir", "part", "--resume", cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert "resumed from part/checkpoints/ckpt-00000023.pt (epoch 1, step 23)" in rest.stdout
    full, b = _summary(digits_reference), _summary(tmp_path / "part")
    assert full["params_sha256"] == b["params_sha256"]
    assert full["steps"] == b["steps"] == REFERENCE_STEPS


def test_resume_mid_epoch_is_bitwise_identical(tmp_path, digits_reference, digits_part):
    """The session's run cut at step 30 (conftest.py), resumed: the reference's parameters."""
    copy_run(digits_part, tmp_path / "part")
    assert _summary(tmp_path / "part")["steps"] == 30
    rest = run_cli(*REFERENCE_JOB, "--run-dir", "part", "--resume", cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert "resumed from part/checkpoints/ckpt-00000030.pt" in rest.stdout
    assert _summary(digits_reference)["params_sha256"] == _summary(tmp_path / "part")["params_sha256"]


@pytest.mark.parametrize(("args", "needle"), [
    (("--epochs", "0"), "train.epochs: Input should be greater than or equal to 1"),
    (("--strategy", "horovod"), "Invalid value for '--strategy'"),
    (("-f", "missing.yaml"), "missing.yaml: no such file"),
    (("nope.py",), "script nope.py: no such file"),
    (("--precision", "fp16"), "fp16 autocast needs a CUDA GPU; on CPU use --precision bf16"),
    (("--example", "mnist", "--data-dir", "/nonexistent"), "MNIST IDX files not found in /nonexistent"),
    (("--name", "Bad_Name"), "name: must be a DNS-1123 label"),
    (("--nproc-per-node", "two"), "is not an integer or 'auto'"),
])
def test_bad_input_exits_2_without_traceback(tmp_path, args, needle):
    if "--precision" in args:
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("fp16 is valid with a GPU")
    res = run_cli("run", *args, cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists(), "nothing may be written on bad input"


def test_bad_spec_file_names_field(tmp_path):
    (tmp_path / "job.yaml").write_text("train:\n  epochs: 2\n  batchsize: 8\n")
    res = run_cli("run", "-f", "job.yaml", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert "job.yaml: train.batchsize: unknown field" in res.stderr
    assert "Traceback" not in res.stderr


def test_explicit_taken_port_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_cli("run", "--master-port", str(port), "--epochs", "1", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert f"master port {port} is already in use" in res.stderr
    assert "--master-port" in res.stderr and "Traceback" not in res.stderr


def test_a_job_that_cannot_start_leaves_the_previous_run_alone(tmp_path):
    old = tmp_path / "runs" / "disttrain"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"old": true}\n')
    (old / "summary.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_cli("run", "--master-port", str(port), "--epochs", "1", cwd=tmp_path, timeout=60)
    assert res.returncode == 2 and f"master port {port} is already in use" in res.stderr
    assert (old / "metrics.jsonl").read_text() == '{"old": true}\n'
    assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl", "summary.json"]



def test_user_script_runs_under_torchrun_with_rank_prefixes(tmp_path):
    script = ROOT / "examples" / "train_ddp.py"
    res = run_cli("run", str(script), "--nproc-per-node", "2", "--", "--epochs", "2",
                  "--save", str(tmp_path / "m.pth"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    assert "[rank0]:epoch 2:" in text
    assert (tmp_path / "m.pth").exists()


def test_failing_script_returns_torchrun_status_and_diagnosis(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    raise ValueError('boom on rank 1')\n")
    res = run_cli("run", str(bad), "--nproc-per-node", "2", cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    assert "error: the job failed (failed rank(s): 1)" in res.stderr
    assert "boom on rank 1" in res.stdout + res.stderr


def test_builtin_worker_under_plain_torchrun(tmp_path):
    """The pod command (torchrun -m disttrain.worker --spec job.yaml) trains as well."""
    import subprocess

    from disttrain.launch.ports import free_port
    from disttrain.spec.job import JobSpec

    spec = JobSpec.from_dict({}, {"epochs": 1, "run_dir": str(tmp_path / "run")})
    (tmp_path / "job.yaml").write_text(spec.to_yaml())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "disttrain.worker", "--spec", "job.yaml"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TMPDIR": str(tmp_path)})   # torchrun's folder
    assert res.returncode == 0, res.stderr[-3000:]
    assert _summary(tmp_path / "run")["params_in_sync"] is True
