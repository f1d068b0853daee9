"""Adapter-only checkpoints (issue 23, item 3), in one process: a model with a frozen base
and a small trainable adapter (`TrainTask.save_frozen=False`, the recipe with LoRA) is saved
without the base, restored onto a freshly loaded base, and a checkpoint that lacks a
trainable key is refused with the key named. The 2-rank DDP and FSDP kill/stop-and-resume
of the recipe itself is in test_causal_lm_dist.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from disttrain.errors import IncompatibleCheckpoint
from disttrain.train.checkpoint import Checkpointer, TrainState, load_latest


class _OneRank:
    """Enough of a Runtime for the Checkpointer at world size 1."""

    rank, world_size, is_rank0 = 0, 1, True

    def all_gather_object(self, obj):
        return [obj]

    def barrier(self) -> None:
        pass


class Adapted(nn.Module):
    """A frozen 256x256 base (what `/models` gives back) plus a rank-4 adapter."""

    def __init__(self, base_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(base_seed)
        self.base = nn.Linear(256, 256)
        self.base.requires_grad_(False)
        self.down = nn.Linear(256, 4, bias=False)
        self.up = nn.Linear(4, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _parts(model: nn.Module, save_frozen: bool, ckpt_dir: Path) -> Checkpointer:
    from disttrain.train.optim import build_optimizer, warmup_lambda
    from disttrain.train.precision import Precision

    opt = build_optimizer("adam", [p for p in model.parameters() if p.requires_grad], 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(2))
    return Checkpointer(_OneRank(), ckpt_dir, model, opt, sched,  # type: ignore[arg-type]
                        Precision.create("fp32", torch.device("cpu")), save_frozen=save_frozen)


def _train(ckpt: Checkpointer, steps: int) -> None:
    for _ in range(steps):
        ckpt.optimizer.zero_grad()
        ckpt.model(torch.randn(8, 256)).pow(2).mean().backward()
        ckpt.optimizer.step()
        ckpt.scheduler.step()


def test_only_the_adapter_is_saved_and_it_resumes_onto_a_fresh_base(tmp_path: Path) -> None:
    sizes = {}
    for save_frozen in (True, False):
        ckpt = _parts(Adapted(), save_frozen, tmp_path / str(save_frozen))
        _train(ckpt, 3)
        ckpt.save(TrainState(step=3, batch_in_epoch=3), write=True)
        sizes[save_frozen] = (tmp_path / str(save_frozen) / "ckpt-00000003.pt").stat().st_size
    saved, _ = load_latest(tmp_path / "False")   # type: ignore[misc]
    assert set(saved["model"]) == {"down.weight", "up.weight"}
    assert saved["frozen_left_out"] == 256 * 256 + 256
    # the frozen base was 256 KiB of the full checkpoint; the adapter-only one has 8 KiB of weights
    assert sizes[False] < sizes[True] / 4, sizes

    trained = ckpt.model.state_dict()
    fresh = _parts(Adapted(), False, tmp_path / "False")   # the base read again, a new adapter
    state, _ = fresh.restore()   # type: ignore[misc]
    assert state.step == 3 and state.batch_in_epoch == 3
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert len(fresh.optimizer.state) == 2   # Adam's moments of the two adapter weights
    # both continue identically (the RNG state came back too)
    torch.manual_seed(1)
    _train(ckpt, 2)
    torch.manual_seed(1)
    _train(fresh, 2)
    assert all(torch.equal(a, b) for a, b in zip(ckpt.model.parameters(), fresh.model.parameters()))


def test_a_checkpoint_missing_a_trainable_key_names_it(tmp_path: Path) -> None:
    ckpt = _parts(Adapted(), False, tmp_path)
    ckpt.save(TrainState(step=1), write=True)
    wider = Adapted()
    wider.side = nn.Linear(256, 2)   # a trainable layer the checkpoint has not seen
    with pytest.raises(IncompatibleCheckpoint, match=r"trainable parameters only.*side\.weight"):
        _parts(wider, False, tmp_path).restore()


def test_a_full_checkpoint_still_loads_into_an_adapter_run(tmp_path: Path) -> None:
    full = _parts(Adapted(base_seed=5), True, tmp_path)
    full.save(TrainState(step=2), write=True)
    other = _parts(Adapted(base_seed=0), False, tmp_path)
    assert other.restore() is not None
    assert torch.equal(other.model.base.weight, full.model.base.weight)   # loaded in full
