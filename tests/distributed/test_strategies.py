"""Strategies on 2 real gloo ranks, by equivalence rather than by eye.

DDP, FSDP (FSDP2 in every sharding mode, and FSDP1) and DP each end where one process
ends on the same global batch; K micro-batches with grad_accum K end where one K-times
batch ends, with exactly one all-reduce per optimizer step; an FSDP run stopped
mid-epoch and resumed from its torch.distributed.checkpoint folder ends bitwise equal to
one that never stopped. All 2-rank trainings share one launch to keep this file fast.

Every assertion runs once per device: `cpu` (gloo) everywhere, and `cuda` (nccl, one GPU
per rank, marked `gpu`) where two GPUs are visible, so the same equivalences also go
through DDP's device_ids, the nccl barrier and FSDP on a CUDA mesh.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 ranks need a CUDA GPU each")]),
]
BACKEND = {"cpu": "gloo", "cuda": "nccl"}
# (rtol, atol) against the one-process reference. CUDA kernels pick their reduction order
# by batch shape (32 per rank vs 64 in one process), so they differ by a little more.
TOLERANCE = {"cpu": (1e-4, 1e-5), "cuda": (1e-3, 1e-4)}

# digits, 1 epoch of SGD: a wide hidden layer so FSDP makes fc1 a unit of its own
# (>= 100k parameters) and the root holds the rest.
BASE = {"epochs": 1, "optimizer": "sgd", "lr": 0.05, "lr_scaling": "none",
        "checkpoint_every_epochs": 0, "task_args": {"hidden_size": 2048}, "seed": 3}
TWO_RANKS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "batch_size": 32},
    "ddp_k4": {"strategy": "ddp", "batch_size": 8, "grad_accum": 4},
    "fsdp": {"strategy": "fsdp", "batch_size": 32},
    "fsdp_k4": {"strategy": "fsdp", "batch_size": 8, "grad_accum": 4},
    "fsdp_hybrid": {"strategy": "fsdp", "batch_size": 32, "fsdp_sharding": "hybrid"},
    "fsdp_none": {"strategy": "fsdp", "batch_size": 32, "fsdp_sharding": "none"},
    "fsdp1": {"strategy": "fsdp", "batch_size": 32, "_fsdp_version": "1"},
    "ddp_ckpt": {"strategy": "ddp", "batch_size": 32, "grad_ckpt": True},
    "fsdp_ckpt": {"strategy": "fsdp", "batch_size": 32, "grad_ckpt": True},
}
# FSDP resume: Adam (optimizer state must come back too), checkpoints every 10 steps.
RESUME = {"strategy": "fsdp", "epochs": 2, "optimizer": "adam", "lr": 0.002,
          "checkpoint_every_steps": 10, "batch_size": 32}


def _fit(overrides: dict[str, Any], run_dir: Path, rt: Any) -> dict[str, Any]:
    from disttrain.distributed.strategies import model_state_dict
    from disttrain.train.build import build_trainer

    overrides = dict(overrides)
    version = overrides.pop("_fsdp_version", None)
    if version:
        os.environ["DISTTRAIN_FSDP_VERSION"] = version
    try:
        trainer = build_trainer(JobSpec.from_dict({}, {**overrides, "run_dir": str(run_dir)}), rt)
        summary = trainer.fit()
        params = {k: v.detach().clone() for k, v in model_state_dict(trainer.model).items()}
    finally:
        os.environ.pop("DISTTRAIN_FSDP_VERSION", None)
    comm = trainer.comm
    return {"params": params, "summary": summary,
            "hook_calls": comm.total_hook_calls if comm else None,
            "allreduce_calls": comm.total_calls if comm else None,
            "model_type": type(trainer.model).__name__}


def _two_rank_runs(base_dir: str, backend: str) -> dict[str, Any]:
    base = Path(base_dir)
    out: dict[str, Any] = {}
    with setup_for_test(backend) as rt:
        for name, extra in TWO_RANKS.items():
            out[name] = _fit({**BASE, **extra}, base / name, rt)
        resume = {k: v for k, v in BASE.items() if k != "checkpoint_every_epochs"}
        out["resume_full"] = _fit({**resume, **RESUME}, base / "full", rt)
        out["resume_part"] = _fit({**resume, **RESUME, "max_steps": 30}, base / "part", rt)
        out["resume_rest"] = _fit({**resume, **RESUME, "resume": True}, base / "part", rt)
        out["ckpt_files"] = sorted(p.name for p in (base / "part" / "checkpoints").iterdir())
    return out


@pytest.fixture(scope="module", params=DEVICES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{name: result} for the 2-rank runs (rank 0's view) and the 1-process references,
    all on one device (the fixture's parameter)."""
    from disttrain.distributed import runtime

    device: str = request.param
    backend = BACKEND[device]
    base = tmp_path_factory.mktemp(f"strategies-{device}")
    results = run_ranks(2, _two_rank_runs, str(base / "two"), backend, timeout_s=200)
    out = dict(results[0])
    out["rank1"] = results[1]
    out["base"] = base / "two"
    out["device"] = device
    with runtime.setup(backend, timeout_s=60, env={}, threads=1) as rt:
        assert rt.device.type == device
        out["single"] = _fit({**BASE, "strategy": "none", "batch_size": 64}, base / "single", rt)
        out["dp"] = _fit({**BASE, "strategy": "dp", "batch_size": 64}, base / "dp", rt)
    return out


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], device: str) -> None:
    assert a.keys() == b.keys()
    rtol, atol = TOLERANCE[device]
    for name, ref in b.items():
        torch.testing.assert_close(a[name], ref, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_hybrid", "fsdp_none", "fsdp1", "dp",
                                  "ddp_ckpt", "fsdp_ckpt"])
def test_strategy_matches_one_process_on_same_global_batch(runs, name):
    _assert_close(runs[name]["params"], runs["single"]["params"], runs["device"])
    assert runs[name]["summary"]["steps"] == runs["single"]["summary"]["steps"] == 23
    if name != "dp":
        _assert_close(runs["rank1"][name]["params"], runs["single"]["params"], runs["device"])
        assert runs[name]["summary"]["params_in_sync"] is True


def test_fsdp_really_shards(runs):
    assert runs["fsdp"]["summary"]["strategy_effective"] == "fsdp"
    assert runs["fsdp"]["model_type"].startswith("FSDP")            # FSDP2: fully_shard in place
    assert runs["fsdp1"]["model_type"] == "FullyShardedDataParallel"
    assert runs["fsdp"]["summary"]["allreduce_bytes_per_step"] == sum(
        v.numel() * 4 for v in runs["single"]["params"].values())


@pytest.mark.parametrize("name", ["ddp_k4", "fsdp_k4"])
def test_grad_accum_equals_k_times_batch(runs, name):
    """719 samples per rank: 90 micro-batches of 8 (the last has 7) in 23 groups, the last
    of 2: it must match 23 batches of 32 (the last has 15)."""
    _assert_close(runs[name]["params"], runs["single"]["params"], runs["device"])
    _assert_close(runs[name]["params"], runs[name.replace("_k4", "")]["params"], runs["device"])
    assert runs[name]["summary"]["steps"] == 23


def test_one_allreduce_per_optimizer_step_with_accumulation(runs):
    for name in ("ddp", "ddp_k4"):
        steps = runs[name]["summary"]["steps"]
        assert runs[name]["hook_calls"] == steps, name       # one bucket per step...
        assert runs[name]["allreduce_calls"] == steps, name  # ...and one all_reduce for it
        assert runs[name]["summary"]["allreduce_calls_per_step"] == 1


def test_dp_without_gpus_runs_as_none_and_recommends_ddp(runs):
    summary = runs["dp"]["summary"]
    if runs["device"] == "cuda":
        pytest.skip("DataParallel really runs on 2+ GPUs (checked against one process above)")
    assert summary["strategy"] == "dp" and summary["strategy_effective"] == "none"
    notes = " ".join(summary["notes"])
    assert "running as strategy none" in notes
    assert "DDP" in notes and "GIL" in notes and "GPU 0" in notes


def test_fsdp_resume_is_exact(runs):
    full, rest = runs["resume_full"]["summary"], runs["resume_rest"]["summary"]
    assert runs["resume_part"]["summary"]["steps"] == 30
    assert full["steps"] == rest["steps"] == 46
    assert full["params_sha256"] == rest["params_sha256"]
    assert any(f.startswith("dcp-") for f in runs["ckpt_files"]), runs["ckpt_files"]
    assert "last.pt" in runs["ckpt_files"]


def test_fsdp_last_pt_loads_into_bare_model(runs):
    """last.pt of an FSDP run still holds plain weights for the unwrapped model."""
    from disttrain.examples.models import SimpleNet
    from disttrain.train.checkpoint import load_latest

    found = load_latest(runs["base"] / "part" / "checkpoints")
    assert found is not None
    ckpt, _ = found
    assert ckpt["dcp"].startswith("dcp-")
    net = SimpleNet(64, 2048, 10)
    net.load_state_dict(ckpt["model"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs 2+ GPUs")
def test_dp_over_gpus_matches_one_device(tmp_path):
    from disttrain.distributed import runtime

    with runtime.setup("nccl", timeout_s=60, env={}, threads=1) as rt:
        dp = _fit({**BASE, "strategy": "dp", "batch_size": 64}, tmp_path / "dp", rt)
        one = _fit({**BASE, "strategy": "none", "batch_size": 64}, tmp_path / "one", rt)
    assert dp["model_type"] == "DataParallel"
    for name, ref in one["params"].items():
        torch.testing.assert_close(dp["params"][name], ref, rtol=1e-3, atol=1e-4, msg=name)
