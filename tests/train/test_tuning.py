"""Tuning options on 2 real gloo ranks: comm hooks (bytes measured by the hook's counter),
PowerSGD and bf16 autocast still learn digits, LR scaling and warm-up, DataLoader workers.

All trainings share one 2-rank launch to keep this file fast.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHORT = {"epochs": 1, "max_steps": 5, "checkpoint_every_epochs": 0}
LEARN = {"epochs": 3, "checkpoint_every_epochs": 0}
CONFIGS: dict[str, dict[str, Any]] = {
    "hook_none": {**SHORT, "comm_hook": "none"},
    "hook_fp16": {**SHORT, "comm_hook": "fp16"},
    "hook_bf16": {**SHORT, "comm_hook": "bf16"},
    "fsdp_bf16": {**SHORT, "strategy": "fsdp", "comm_hook": "bf16"},
    "powersgd": {**LEARN, "comm_hook": "powersgd"},
    "bf16": {**LEARN, "precision": "bf16"},
    "warmup": {**SHORT, "max_steps": 8, "warmup_steps": 5, "log_every_steps": 1,
               "lr_scaling": "sqrt"},
    "workers0": {**SHORT, "max_steps": 12, "optimizer": "sgd"},
    "workers2": {**SHORT, "max_steps": 12, "optimizer": "sgd", "num_workers": 2},
}


def _runs(base_dir: str) -> dict[str, Any]:
    from disttrain.rundir import read_metrics
    from disttrain.train.build import build_trainer

    out: dict[str, Any] = {}
    with setup_for_test() as rt:
        for name, overrides in CONFIGS.items():
            run_dir = Path(base_dir) / name
            spec = JobSpec.from_dict({}, {**overrides, "run_dir": str(run_dir)})
            summary = build_trainer(spec, rt).fit()
            lrs = [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl")
                   if r.get("split") == "train" and r["rank"] == 0] if rt.is_rank0 else []
            out[name] = {"summary": summary, "lrs": lrs}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(2, _runs, str(tmp_path_factory.mktemp("tuning")), timeout_s=200)[0]


def _bytes(runs: dict[str, Any], name: str) -> int:
    return runs[name]["summary"]["allreduce_bytes_per_step"]


def test_half_precision_hooks_halve_the_bytes(runs):
    full = _bytes(runs, "hook_none")
    assert full == 38_410 * 4   # every fp32 gradient of SimpleNet(64, 512, 10), once
    assert _bytes(runs, "hook_fp16") == full // 2
    assert _bytes(runs, "hook_bf16") == full // 2
    assert _bytes(runs, "fsdp_bf16") == full // 2
    for name in ("hook_none", "hook_fp16", "hook_bf16"):
        assert runs[name]["summary"]["allreduce_calls_per_step"] == 1
        assert runs[name]["summary"]["params_in_sync"] is True


def test_powersgd_compresses_and_still_learns_digits(runs):
    s = runs["powersgd"]["summary"]
    assert s["test_accuracy"] >= 0.9
    assert s["params_in_sync"] is True
    # rank-1 P and Q per weight matrix plus the uncompressed biases, in 3 all-reduces
    assert 0 < s["allreduce_bytes_per_step"] < _bytes(runs, "hook_none") / 10
    assert s["allreduce_calls_per_step"] == 3


def test_bf16_autocast_on_cpu_learns_digits(runs):
    s = runs["bf16"]["summary"]
    assert s["precision"] == "bf16" and s["test_accuracy"] >= 0.9


def test_lr_scaling_and_warmup_are_applied_and_reported(runs):
    s = runs["warmup"]["summary"]
    assert s["lr_base"] == 0.001 and s["lr_scaling"] == "sqrt" and s["warmup_steps"] == 5
    assert s["lr_effective"] == pytest.approx(0.001 * math.sqrt(2))
    assert s["global_batch"] == 64
    lrs = runs["warmup"]["lrs"]
    assert lrs == sorted(lrs) and lrs[0] < s["lr_effective"]
    assert lrs[-1] == pytest.approx(s["lr_effective"])


def test_dataloader_workers_give_the_same_training(runs):
    a, b = runs["workers0"]["summary"], runs["workers2"]["summary"]
    assert a["steps"] == b["steps"] == 12
    assert a["params_sha256"] == b["params_sha256"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="fp16 needs CUDA")
def test_fp16_on_gpu_uses_a_grad_scaler_saved_in_checkpoints(tmp_path):
    from disttrain.distributed import runtime
    from disttrain.train.build import build_trainer
    from disttrain.train.checkpoint import load_latest

    with runtime.setup("nccl", timeout_s=60, env={}, threads=1) as rt:
        spec = JobSpec.from_dict({}, {**LEARN, "precision": "fp16", "checkpoint_every_epochs": 1,
                                      "run_dir": str(tmp_path / "fp16")})
        trainer = build_trainer(spec, rt)
        summary = trainer.fit()
    assert trainer.precision.scaler is not None and summary["test_accuracy"] >= 0.9
    found = load_latest(tmp_path / "fp16" / "checkpoints")
    assert found is not None and found[0]["scaler"]["scale"] > 0
