"""The one-process chargpt run that the tensor / pipeline parallel files compare with
(tests/distributed/test_parallel_trainer.py: tp=2, pp=2 on 2 ranks; test_composed_parallel.py:
pp x dp, FSDP2 x tp, DDP x tp on 4): the same job, so it is trained once per session and
shared by the pytest-xdist workers (`_made_once`), not once per file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import _made_once, run_cli

CHARGPT_STEPS = 30
# a tiny chargpt (2 blocks of 4 heads, 16-character windows), 30 SGD steps at lr 0.5, a
# checkpoint every 10 (the step-30 .pt holds the consolidated weights the files compare)
CHARGPT_JOB = ("run", "--example", "chargpt", "--task-args",
               '{"block": 16, "layers": 2, "width": 32, "heads": 4}',
               "--max-steps", str(CHARGPT_STEPS), "--epochs", "1", "--optimizer", "sgd",
               "--lr", "0.5", "--log-every-steps", "1", "--checkpoint-every-steps", "10",
               "--master-port", "0")
ONE_PROCESS = ("--nproc-per-node", "1", "--batch-size", "8")


@pytest.fixture(scope="session")
def chargpt_one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of CHARGPT_JOB on one process, batch 8: read it, never change it."""

    def make(cwd: Path) -> Path:
        res = run_cli(*CHARGPT_JOB, *ONE_PROCESS, "--run-dir", "one", cwd=cwd, timeout=420)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        return cwd / "one"

    return _made_once(tmp_path_factory, "chargpt-one-process", make)


def run_chargpt(base: Path, name: str, nproc: int, *extra: str, job: tuple[str, ...],
                env: dict | None = None) -> Path:
    """`disttrain run` of `job` on `nproc` processes into `base/name`; with a fault in
    `env`, also that it fired and the job resumed."""
    res = run_cli(*job, "--nproc-per-node", str(nproc), "--run-dir", name, *extra, cwd=base,
                  timeout=420, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # nothing a killed rank left registered (a pp stage run by torch.fx.Interpreter did)
    assert "leaked semaphore" not in out, out[-4000:]
    if env and "DISTTRAIN_FAULT" in env:
        assert "disttrain fault injection" in out, "the fault never fired"
        assert "resumed from" in out, out[-4000:]
    return base / name


def rank_losses(run: Path, rank: int = 0) -> dict[int, float]:
    """{step: loss} of one rank's train rows."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train" and r["rank"] == rank}


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The consolidated weights of the step-CHARGPT_STEPS checkpoint."""
    path = run / "checkpoints" / f"ckpt-{CHARGPT_STEPS:08d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def summary_of(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())
