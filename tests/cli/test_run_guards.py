"""Guards of `disttrain run` and the built-in job: dp process count, combinations refused
up front, run-dir clearing under `--launcher env`, and the rank-0-first dataset download."""

from __future__ import annotations

import time
from pathlib import Path

import click
import pytest

from disttrain.cli.run_cmd import _prepare_run_dir
from disttrain.launch.argv import resolve_nproc, torchrun_argv
from disttrain.rundir import RUN_OUTPUTS
from disttrain.spec.job import JobSpec
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(180)


def _spec(**overrides) -> JobSpec:
    return JobSpec.from_dict({}, overrides)


# -- 1. dp runs one process ----------------------------------------------------------
@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_dp_auto_is_one_process(gpus):
    assert resolve_nproc(_spec(strategy="dp"), gpus=gpus) == 1
    assert "--nproc_per_node=1" in torchrun_argv(_spec(strategy="dp"))


@pytest.mark.parametrize(("overrides", "gpus", "want"), [
    ({}, 0, 2), ({}, 4, 4), ({"strategy": "fsdp"}, 3, 3),
    ({"strategy": "dp", "nproc_per_node": 1}, 4, 1),
    ({"script": "train.py", "strategy": "dp"}, 0, 2),  # a script ignores `train`
])
def test_other_nproc_unchanged(overrides, gpus, want):
    assert resolve_nproc(_spec(**overrides), gpus=gpus) == want


# -- 2. combinations refused before any process starts --------------------------------
@pytest.mark.parametrize(("args", "needles"), [
    (("--strategy", "dp", "--nproc-per-node", "2"),
     ("launch.nproc_per_node", "ONE process", "--nproc-per-node 1", "--strategy ddp")),
    (("--strategy", "dp", "--nnodes", "2", "--nproc-per-node", "1"),
     ("launch.nnodes", "one process on one machine", "--strategy ddp")),
    (("--strategy", "fsdp", "--comm-hook", "powersgd"),
     ("train.comm_hook: powersgd is a DDP comm hook", "--strategy ddp")),
])
def test_bad_combination_exits_2_and_leaves_run_dir(tmp_path, args, needles):
    earlier = tmp_path / "runs" / "disttrain" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("earlier run\n")
    res = run_cli("run", *args, cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    for needle in needles:
        assert needle in res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in earlier.parent.iterdir()) == ["metrics.jsonl"]
    assert earlier.read_text() == "earlier run\n"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_env_launcher_dp_with_world_size_2_exits_2(tmp_path, rank):
    """Each rank is its own `disttrain run`: both refuse before touching the run dir."""
    earlier = tmp_path / "runs" / "disttrain" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("earlier run\n")
    env = {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    res = run_cli("run", "--launcher", "env", "--strategy", "dp", cwd=tmp_path, timeout=60, env=env)
    assert res.returncode == 2, res.stderr
    assert "WORLD_SIZE=2: strategy dp is ONE process" in res.stderr
    assert "--strategy ddp" in res.stderr and "Traceback" not in res.stderr
    assert earlier.read_text() == "earlier run\n"


def test_script_is_not_held_to_builtin_strategy_rules(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    # a flag --strategy is refused with a script (tests/cli/test_run_script.py); a spec
    # file's train section is the built-in job's and left unjudged
    (tmp_path / "job.yaml").write_text("train: {strategy: dp}\n")
    res = run_cli("run", "train.py", "-f", "job.yaml", "--nproc-per-node", "2", "--dry-run",
                  cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--nproc_per_node=2" in res.stdout


# -- 3. only rank 0 clears the run dir under --launcher env ---------------------------
def _earlier_run(run_dir: Path) -> tuple[Path, Path]:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"weights")
    metrics = run_dir / RUN_OUTPUTS[0]
    metrics.write_text("earlier run\n")
    return metrics, run_dir / "checkpoints"


def _env_rank(monkeypatch, rank: int) -> None:
    for k, v in {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))


def test_env_rank_1_does_not_clear_run_dir(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    metrics, ckpt = _earlier_run(run_dir)
    _env_rank(monkeypatch, 1)
    spec = _spec(launcher="env", run_dir=str(run_dir))
    spec_path = _prepare_run_dir(spec)
    assert metrics.read_text() == "earlier run\n" and (ckpt / "last.pt").exists()
    assert spec_path == run_dir / "job.yaml" and "launcher: env" in spec_path.read_text()


@pytest.mark.parametrize(("launcher", "rank"), [("env", 0), ("env", None), ("torchrun", 1)])
def test_rank_0_or_other_launchers_clear_run_dir(tmp_path, monkeypatch, launcher, rank):
    run_dir = tmp_path / "run"
    metrics, ckpt = _earlier_run(run_dir)
    if rank is not None:
        _env_rank(monkeypatch, rank)
    else:
        for name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
    _prepare_run_dir(_spec(launcher=launcher, run_dir=str(run_dir)))
    assert not metrics.exists() and not ckpt.exists()
    assert (run_dir / "job.yaml").exists()


def test_env_malformed_rank_is_refused_before_deleting(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    metrics, _ = _earlier_run(run_dir)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(click.exceptions.Exit) as exc:
        _prepare_run_dir(_spec(launcher="env", run_dir=str(run_dir)))
    assert exc.value.exit_code == 2
    assert "WORLD_SIZE is not set" in capsys.readouterr().err
    assert metrics.exists() and not (run_dir / "job.yaml").exists()


# -- 4. local rank 0 downloads before the other ranks load ---------------------------
def _build_with_download(marker: str, run_dir: str) -> list[bool]:
    """build_trainer on this rank with a loader that fails unless rank 0 went first."""
    from disttrain.examples import mnist
    from disttrain.testing import setup_for_test
    from disttrain.train import build as builder

    real, calls = mnist.load_dataset, []

    def fake_load(example: str, *, download: bool = False, **kwargs):
        calls.append(download)
        if download:  # rank 0 "downloads": slow, then the files are there
            time.sleep(0.5)
            Path(marker).touch()
        elif not Path(marker).exists():
            raise FileNotFoundError("dataset files not there yet: rank 0 is still downloading")
        return real("digits")   # stands in for the downloaded files

    mnist.load_dataset = fake_load
    with setup_for_test() as rt:
        spec = _spec(task="disttrain.examples.mnist:make_task", task_args={"download": True},
                     run_dir=run_dir, epochs=1, checkpoint_every_epochs=0)
        builder.build_trainer(spec, rt)
    return calls


def test_build_trainer_rank0_downloads_before_others_load(tmp_path):
    from disttrain.testing import run_ranks

    out = run_ranks(2, _build_with_download, str(tmp_path / "marker"), str(tmp_path / "run"),
                    timeout_s=60)
    assert out == {0: [True], 1: [False]}


def _rank0_load_fails() -> tuple[str, float]:
    from disttrain.examples.mnist import load_splits_local_rank0_first
    from disttrain.testing import setup_for_test

    def load(download: bool):
        raise FileNotFoundError(f"download={download}")

    with setup_for_test() as rt:
        t0 = time.monotonic()
        try:
            load_splits_local_rank0_first(rt, load, download=True)
        except FileNotFoundError as exc:
            return str(exc), time.monotonic() - t0
    raise AssertionError("load did not raise")


def test_failed_download_does_not_leave_others_waiting():
    from disttrain.testing import run_ranks

    out = run_ranks(2, _rank0_load_fails, timeout_s=60)
    assert out[0][0] == "download=True" and out[1][0] == "download=False"
    assert out[1][1] < 30, "rank 1 waited for the collective timeout"


class _FakeNodeRank:
    """A rank of a 2-node job (2 ranks per node): enough of Runtime for the loader."""

    def __init__(self, rank: int) -> None:
        self.world_size, self.local_rank, self.events = 4, rank % 2, []

    def barrier(self) -> None:
        self.events.append("barrier")


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_each_node_downloads_once_before_its_other_ranks_load(rank):
    """Nodes need not share a filesystem: local rank 0 of every node downloads."""
    from disttrain.examples.mnist import load_splits_local_rank0_first

    rt = _FakeNodeRank(rank)
    load_splits_local_rank0_first(rt, lambda download: rt.events.append(download), True)
    assert rt.events == ([True, "barrier"] if rank % 2 == 0 else ["barrier", False])
