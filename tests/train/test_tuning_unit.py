"""Single-process unit tests of the tuning and strategy pieces (no process group needed)."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from disttrain.distributed.activation_ckpt import enable_grad_ckpt
from disttrain.distributed.comm_hooks import CommStats, powersgd_start_iter
from disttrain.distributed.env import DistEnv, add_dist_args, env_from_args
from disttrain.distributed.fsdp import mesh_shape, size_based_units
from disttrain.distributed.process import rank_seed
from disttrain.distributed.strategies import resolve_strategy
from disttrain.errors import DistEnvError, PrecisionError, StrategyError
from disttrain.spec.job import JobSpec
from disttrain.train.loader import ShardedLoader, batch_seed
from disttrain.train.optim import build_optimizer, global_batch, scaled_lr, warmup_lambda
from disttrain.train.precision import Precision


def test_lr_scaling_rules():
    assert global_batch(32, 4, 2) == 256
    assert scaled_lr(0.001, "linear", 32, 4, 1) == pytest.approx(0.004)   # 4 ranks: 4x the LR
    assert scaled_lr(0.001, "sqrt", 32, 4, 1) == pytest.approx(0.002)
    assert scaled_lr(0.001, "linear", 32, 2, 4) == pytest.approx(0.008)   # accumulation counts
    assert scaled_lr(0.001, "none", 32, 4, 4) == 0.001
    with pytest.raises(ValueError, match="lr_scaling"):
        scaled_lr(0.001, "cubic", 32, 4, 1)


def test_warmup_is_linear_then_constant():
    f = warmup_lambda(4)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_lambda(0)(0) == 1.0


def test_fp16_on_cpu_is_refused_pointing_to_bf16():
    with pytest.raises(PrecisionError, match="on CPU use --precision bf16"):
        Precision.create("fp16", torch.device("cpu"))
    bf16 = Precision.create("bf16", torch.device("cpu"))
    with bf16.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and bf16.scaler is None


def test_no_deprecated_amp_spellings():
    import inspect

    import disttrain.train.precision
    import disttrain.train.trainer

    for mod in (disttrain.train.precision, disttrain.train.trainer):
        lines = inspect.getsource(mod).replace("`torch.cuda.amp`", "").splitlines()
        old = [i for i, line in enumerate(lines) if "torch.cuda.amp" in line]
        # only as the fallback of torch < 2.3, which has no torch.amp.GradScaler
        assert all('not hasattr(torch.amp, "GradScaler")' in lines[i - 1] for i in old), old


def test_adam_is_fused_and_matches_the_loop_version():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    fused, loop = build_optimizer("adam", a.parameters(), 0.01), \
        build_optimizer("adam", b.parameters(), 0.01, fused=False)
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    x = torch.randn(16, 8)
    for _ in range(5):
        for net, opt in ((a, fused), (b, loop)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-6)


def _rt(world: int, cuda: int = 0) -> SimpleNamespace:
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    return SimpleNamespace(world_size=world, device=dev, env=DistEnv(world_size=world))


def test_resolve_strategy():
    assert resolve_strategy("ddp", _rt(2)) == ("ddp", None)
    name, note = resolve_strategy("ddp", _rt(1))
    assert name == "none" and "world size 1" in note
    assert resolve_strategy("fsdp", _rt(1))[0] == "none"
    name, note = resolve_strategy("dp", _rt(1))
    if torch.cuda.device_count() < 2:
        assert name == "none" and "running as strategy none" in note
    with pytest.raises(StrategyError, match="--nproc-per-node 1"):
        resolve_strategy("dp", _rt(2))
    with pytest.raises(StrategyError, match="unknown strategy"):
        resolve_strategy("horovod", _rt(2))


def test_fsdp_units_are_chosen_by_size():
    """torch's size-based rule: a unit holds >= min_params not already in a smaller unit."""
    inner = nn.Sequential(nn.Linear(1000, 50), nn.Linear(50, 10))       # 50,050 + 510
    model = nn.Sequential(nn.Linear(100, 1000), nn.ReLU(), inner)        # 101,000 first
    assert size_based_units(model, min_params=40_000) == [model[0], inner[0]]
    assert size_based_units(model, min_params=50_500) == [model[0], inner]
    assert size_based_units(model, min_params=200_000) == []            # the root takes all


def test_fsdp_mesh_shapes():
    assert mesh_shape(8, 4, "full") == (8,)
    assert mesh_shape(8, 4, "hybrid") == (2, 4)      # replicate over nodes, shard inside one
    assert mesh_shape(8, 4, "none") == (8, 1)
    with pytest.raises(ValueError, match="same number of processes"):
        mesh_shape(6, 4, "hybrid")


def test_grad_ckpt_keeps_the_gradients():
    from disttrain.examples.models import Seed002Net, SimpleNet

    for make in (lambda: SimpleNet(16, 32, 10), lambda: Seed002Net(16, 10)):
        torch.manual_seed(0)
        ref, ckpt = make(), make()
        ckpt.load_state_dict(ref.state_dict())
        assert enable_grad_ckpt(ckpt)
        x, y = torch.randn(4, 16), torch.randint(0, 10, (4,))
        for net in (ref, ckpt):
            nn.functional.cross_entropy(net(x), y).backward()
        for p, q in zip(ref.parameters(), ckpt.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert ckpt.state_dict().keys() == ref.state_dict().keys()


def test_comm_stats_per_step():
    stats = CommStats()
    stats.hook_calls, stats.calls, stats.bytes = 1, 3, 600
    stats.end_step()
    stats.end_step()    # an accumulation step without communication keeps the last figures
    assert stats.summary() == {"allreduce_bytes_per_step": 600, "allreduce_calls_per_step": 3,
                               "allreduce_bytes_mean": 300}
    assert powersgd_start_iter(50) == 5 and powersgd_start_iter(5) == 2
    assert powersgd_start_iter(10**6) == 1000


def _parse(*argv: str) -> argparse.Namespace:
    return add_dist_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_world_size_rank_flags():
    env = env_from_args(_parse("--world-size", "4", "--rank", "3", "--master-port", "1234"), {})
    assert env is not None
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("4", "3", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "1234")
    assert env_from_args(_parse(), {}) is None                    # torchrun: read the env
    legacy = env_from_args(_parse("--local_rank=1"), {"RANK": "1", "WORLD_SIZE": "2"})
    assert legacy is not None and legacy["LOCAL_RANK"] == "1"    # torch.distributed.launch
    with pytest.raises(DistEnvError, match="needs --rank R"):
        env_from_args(_parse("--world-size", "4"), {})
    with pytest.raises(DistEnvError, match=r"must be in 0\.\.3"):
        env_from_args(_parse("--world-size", "4", "--rank", "4"), {})


def test_rank_seeds_differ_and_repeat():
    seeds = {rank_seed(0, r) for r in range(8)}
    assert len(seeds) == 8 and rank_seed(0, 3) == rank_seed(0, 3)
    assert batch_seed(0, 0, 0, 0) != batch_seed(0, 1, 0, 0) != batch_seed(0, 0, 1, 0)


def _noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=g)


def test_augmentation_is_per_rank_and_the_same_with_workers_and_after_resume():
    x, y = torch.zeros(40, 3), torch.arange(40)
    def batches(rank: int, workers: int, skip: int = 0) -> list[torch.Tensor]:
        loader = ShardedLoader(x, y, 4, rank=rank, world_size=2, seed=1, num_workers=workers,
                               transform=_noise)
        loader.set_epoch(2)
        loader.skip = skip
        return [b for b, _ in loader]
    r0, r1 = batches(0, 0), batches(1, 0)
    assert len(r0) == 5 and not torch.equal(r0[0], r1[0])
    w0 = batches(0, 2)
    assert all(torch.equal(a, b) for a, b in zip(r0, w0, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(r0[3:], batches(0, 0, skip=3), strict=True))


def test_batch_lengths_cover_the_shard():
    loader = ShardedLoader(torch.zeros(719, 1), torch.zeros(719), 8)
    assert len(loader) == 90
    assert sum(loader.batch_len(i) for i in range(90)) == 719 and loader.batch_len(89) == 7


def test_planned_steps_counts_short_last_group():
    from disttrain.train.build import planned_steps

    cfg = JobSpec.from_dict({}, {"grad_accum": 4, "epochs": 2}).train
    assert planned_steps(cfg, 90) == 2 * math.ceil(90 / 4)
    cfg = JobSpec.from_dict({}, {"grad_accum": 4, "epochs": 2, "max_steps": 5}).train
    assert planned_steps(cfg, 90) == 5


def test_run_info_is_the_summarys_first_keys_in_order():
    from dataclasses import fields
    from pathlib import Path

    from disttrain.train.run_info import RunInfo

    values = {f.name: 0 for f in fields(RunInfo) if f.name not in ("notes", "first_step_s",
                                                                    "first_step_measured")}
    info = RunInfo(**{**values, "run_dir": Path("runs/x")})
    d = info.as_dict()
    assert list(d)[:3] == ["name", "workload", "strategy"] and list(d)[-2:] == ["run_dir", "notes"]
    assert d["run_dir"] == "runs/x" and "first_step_s" not in d, "only a run that took step 1"
    info.record_first_step(None)  # no launch time known: the key is there, with null
    assert list(info.as_dict())[-1] == "first_step_s" and info.as_dict()["first_step_s"] is None


def test_builtin_accuracy_metric_is_a_sum_and_a_count():
    from disttrain.examples.classify import accuracy

    out = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    correct, count = accuracy(out, (out, y))
    assert correct.item() == 2 and count == 3


def test_grad_ckpt_reaches_blocks_in_a_module_list():
    """chargpt keeps its blocks in an nn.ModuleList (no forward of its own): each block is
    checkpointed, and the gradients are those of the plain model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from disttrain.examples.chargpt import CharGPT

    torch.manual_seed(0)
    ref = CharGPT(vocab=11, block=8, layers=2, width=16, heads=2, dropout=0.0)
    ckpt = CharGPT(vocab=11, block=8, layers=2, width=16, heads=2, dropout=0.0)
    ckpt.load_state_dict(ref.state_dict())
    assert enable_grad_ckpt(ckpt).startswith("checkpoint_wrapper on ")
    assert all(isinstance(b, CheckpointWrapper) for b in ckpt.blocks)
    x = torch.randint(0, 11, (3, 8))
    for net in (ref, ckpt):
        net(x).sum().backward()
    for p, q in zip(ref.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert ckpt.state_dict().keys() == ref.state_dict().keys()
