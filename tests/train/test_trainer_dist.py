"""Real 2-rank gloo runs of the Trainer: sharding, DDP equivalence, eval, rank-0 writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from disttrain.examples.datasets import load_digits
from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test
from disttrain.train.loader import ShardedLoader
from tests.conftest import WITH_LOSS_PNG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_shards_are_disjoint_and_reshuffled_each_epoch():
    x = torch.arange(100).float().unsqueeze(1)
    y = torch.zeros(100, dtype=torch.long)
    loaders = [ShardedLoader(x, y, batch_size=8, rank=r, world_size=2, seed=0) for r in range(2)]
    seen = []
    for loader in loaders:
        loader.set_epoch(0)
        seen.append([int(v) for xb, _ in loader for v in xb.flatten()])
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(range(100))
    loaders[0].set_epoch(1)
    epoch1 = [int(v) for xb, _ in loaders[0] for v in xb.flatten()]
    assert epoch1 != seen[0], "set_epoch must change the order"


def test_sharded_loader_matches_dataloader():
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(50, 3), torch.randint(0, 10, (50,))
    ours = ShardedLoader(x, y, batch_size=7, rank=1, world_size=2, seed=3)
    ref = DataLoader(TensorDataset(x, y), batch_size=7, sampler=ours.sampler)
    ours.set_epoch(2)
    for (a, b), (c, d) in zip(ours, ref, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def _train_digits(world_batch: int, run_dir: str, single: bool = False):
    """Train 1 epoch of digits with SGD, return (params, evaluate(), local full eval)."""
    from disttrain.distributed import runtime
    from disttrain.distributed.strategies import unwrap
    from disttrain.train.build import build_trainer

    overrides = {"epochs": 1, "optimizer": "sgd", "lr": 0.05, "lr_scaling": "none",
                 "checkpoint_every_epochs": 0, "run_dir": run_dir}
    ctx = runtime.setup("gloo", timeout_s=60, env={}, threads=1) if single else setup_for_test()
    with ctx as rt:
        overrides["batch_size"] = world_batch // rt.world_size
        spec = JobSpec.from_dict({}, overrides)
        trainer = build_trainer(spec, rt)
        summary = trainer.fit()
        ev = trainer.evaluate()
        net = unwrap(trainer.model)
        test_x, test_y = trainer.task.eval_data.tensors
        with torch.no_grad():
            out = net(test_x)
            full = (torch.nn.functional.cross_entropy(out, test_y).item(),
                    (out.argmax(1) == test_y).float().mean().item())
        params = {k: v.clone() for k, v in net.state_dict().items()}
        return params, ev, full, summary


def test_ddp_two_ranks_equals_one_process_on_same_global_batch(tmp_path):
    results = run_ranks(2, _train_digits, 64, str(tmp_path / "ddp"), timeout_s=120)
    single_params, _, _, _ = _train_digits(64, str(tmp_path / "single"), single=True)
    for rank in (0, 1):
        params = results[rank][0]
        for name, ref in single_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-5, msg=name)
    assert results[0][3]["params_in_sync"] is True


def test_eval_is_over_all_ranks_not_rank0_shard(tmp_path):
    results = run_ranks(2, _train_digits, 64, str(tmp_path / "ddp"), timeout_s=120)
    for rank in (0, 1):
        _, ev, (full_loss, full_acc), _ = results[rank]
        loss, acc = ev["loss"], ev["accuracy"]
        assert acc == pytest.approx(full_acc, abs=1e-6)
        assert loss == pytest.approx(full_loss, rel=1e-5)


def _build_in_own_dir(base: str):
    from disttrain.train.build import build_trainer

    rank = int(os.environ["RANK"])
    own = Path(base) / f"cwd{rank}"
    own.mkdir(parents=True, exist_ok=True)
    os.chdir(own)
    with setup_for_test() as rt:
        spec = JobSpec.from_dict({}, {"epochs": 1, "max_steps": 3, "run_dir": "out",
                                      "checkpoint_every_steps": 1})
        build_trainer(spec, rt).fit()
    return sorted(str(p.relative_to(own)) for p in own.rglob("*"))


def test_only_rank0_writes(tmp_path):
    results = run_ranks(2, _build_in_own_dir, str(tmp_path), timeout_s=120, env=WITH_LOSS_PNG)
    # each rank's own live status (train/step_timing.py) is the one file every rank writes
    assert results[1] == ["out", "out/live", "out/live/rank-1.json"], f"rank 1 wrote files: {results[1]}"
    assert {"out/summary.json", "out/metrics.jsonl", "out/job.yaml", "out/checkpoints/last.pt",
            "out/loss.png"} <= set(results[0])


def test_digits_split_is_fixed_and_disjoint():
    a, b = load_digits(), load_digits()
    assert torch.equal(a.train_x, b.train_x) and len(a.test_x) == 359
    assert a.input_size == 64 and int(a.train_y.max()) == 9
