"""Pipeline parallel and FSDP2 x TP for a GPT2-style `transformers` model (issue 26 must-show):
the tiny random GPT2LMHeadModel of test_tp_gpt2.py (2 blocks, n_embd 32, 4 heads, built from
a config: nothing downloaded), 30 SGD steps at lr 0.1 on the same counting batches, against
one process:

- pp=2 on two gloo ranks, GPipe and 1F1B (2 micro-batches of 2 rows), one spawn: the model
  is cut by torch's tracing frontend at the `GPT2Block` boundaries that `balanced_cuts`
  picks (`transformer.h.1`: embeddings + block 0 on stage 0, block 1 + ln_f + lm_head on
  stage 1), no GPT2-specific split rule: GPT2LMHeadModel exports as it is, behind a
  wrapper whose forward returns the logits tensor (what a stage passes on). The head is
  tied to the token embedding, so both stages hold a copy; `sync_tied_grads` sums their
  gradients (pipeline.py's docstring).
- dp_shard=2 x tp=2 on four gloo ranks: `gpt2_plan` over tp, then FSDP2 over dp_shard
  (`composed.fully_shard_tp`, one unit per GPT2Block); the fused c_attn Conv1D weight is
  tp-strided along its output dim (1), so FSDP shards it along dim 0, and its 1-D bias stays
  out of FSDP with its gradient averaged by `average_grads`. Each data slice trains on 2 of
  the batch's 4 rows; the loss of a step is the mean of the two slices' losses.

Tolerance: fp32, rtol 1e-4 / atol 5e-5 on the loss curve and on every gathered parameter
(test_tp_gpt2.py's: the micro-batch / data-slice means and tp's all-reduces add the same
numbers in another order). Measured on this CPU after 30 steps (losses ~3.5 falling to
~1.7), gpipe / 1f1b / fsdp x tp: losses at most 5.5e-6 / 5.5e-6 / 1.7e-5 apart, parameters
3.6e-7 / 3.6e-7 / 7.0e-7 (printed under `pytest -s`). Both tests together: ~50 s here (two
spawns; most of it is starting ranks, importing transformers and tracing the stages).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from disttrain.testing import run_ranks, setup_for_test
from tests.conftest import needs
from tests.distributed import test_tp_gpt2
from tests.distributed.test_tp_gpt2 import (
    LR,
    SEED,
    STEPS,
    _batch,
    _model,
)

pytestmark = [needs("transformers")]

RTOL, ATOL = 1e-4, 5e-5
MICROBATCHES = 2
PP_MODES = ("gpipe", "1f1b")


class Logits(nn.Module):
    """GPT2LMHeadModel as a pipeline traces it: ids in, the logits tensor out (its own
    output is a ModelOutput dataclass, and the loss belongs to the last stage)."""

    def __init__(self, gpt2: nn.Module) -> None:
        super().__init__()
        self.gpt2 = gpt2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=ids, use_cache=False).logits

# the one-process run is test_tp_gpt2's fixture, not a second copy of it
reference = test_tp_gpt2.reference


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT2LMHeadModel's loss for labels=ids: each position predicts the next token."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))


def _pp_modes() -> dict[str, dict[str, Any]]:
    """Both schedules trained from the same seed on this rank, one process group."""
    rt = setup_for_test()
    try:
        return {mode: _train_pp(mode, rt) for mode in PP_MODES}
    finally:
        rt.shutdown()


def _train_pp(schedule: str, rt: Any) -> dict[str, Any]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from disttrain.distributed.mesh import build_mesh
    from disttrain.distributed.pipeline import PipelinedModel, balanced_cuts, interpreted
    from disttrain.spec.parallelism import ParallelismSpec, resolve_degrees

    mesh = build_mesh(resolve_degrees(ParallelismSpec(pp=2), rt.world_size), rt)
    torch.manual_seed(SEED)
    model = Logits(_model())
    cuts = balanced_cuts(model, GPT2Block, 2)
    gen = torch.Generator().manual_seed(SEED)
    first = _batch(gen)
    rows = first.shape[0] // MICROBATCHES
    pipe = PipelinedModel.build(model, cuts, (first[:rows],), mesh["pp"], schedule, MICROBATCHES,
                                next_token_loss, rt.device)
    opt = torch.optim.SGD(pipe.parameters(), LR)
    gen = torch.Generator().manual_seed(SEED)
    losses = []
    for _ in range(STEPS):
        ids = _batch(gen)
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, ids)
        pipe.sync_tied_grads()
        opt.step()
        out = torch.zeros(()) if loss is None else loss.reshape(())
        torch.distributed.broadcast(out, src=1, group=pipe.group)   # the last stage's
        losses.append(out.item())
    params = {n.removeprefix("gpt2."): p for n, p in pipe.full_state_dict().items()}
    return {"losses": losses, "params": params, "cuts": cuts, "stage": pipe.stage_index,
            "held": sorted(n for n, _ in pipe.stage_module.named_parameters()),
            "interpreted": interpreted(pipe.stage_module)}


def _train_fsdp_tp() -> dict[str, Any]:
    """dp_shard=2 x tp=2: this rank's data slice (rows of the batch), the loss of the
    whole batch (the dp mean of the slices'), the parameters gathered to full tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from disttrain.distributed.composed import average_grads, fully_shard_tp
    from disttrain.distributed.mesh import build_mesh, data_rank
    from disttrain.distributed.tensor_parallel import apply_tp, check_heads, full_state_dict
    from disttrain.distributed.tp_plans import gpt2_plan
    from disttrain.spec.parallelism import ParallelismSpec, resolve_degrees

    rt = setup_for_test()
    try:
        mesh = build_mesh(resolve_degrees(ParallelismSpec(tp=2), rt.world_size), rt)
        dp_rank, dp_size = data_rank(mesh)
        dp_group = mesh["dp_shard"].get_group()
        torch.manual_seed(SEED)
        model = _model()
        check_heads(model, 2)
        apply_tp(model, mesh["tp"], gpt2_plan)
        kept = fully_shard_tp(model, mesh["dp_shard"], (GPT2Block,), gloo=True)
        c_attn = model.transformer.h[0].attn.c_attn.weight
        opt = torch.optim.SGD(model.parameters(), LR)
        gen = torch.Generator().manual_seed(SEED)
        losses = []
        for _ in range(STEPS):
            ids = _batch(gen).chunk(dp_size)[dp_rank]
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            average_grads(kept, dp_group)
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)
            losses.append(mean.item() / dp_size)
        return {"losses": losses, "params": full_state_dict(model), "dp_rank": dp_rank,
                "kept": sorted(n for n, p in model.named_parameters() if any(p is k for k in kept)),
                "c_attn": (str(c_attn.placements), tuple(c_attn.to_local().shape))
                if isinstance(c_attn, DTensor) else None}
    finally:
        rt.shutdown()


def _max_diff(got: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    loss = (torch.tensor(got["losses"]) - torch.tensor(ref["losses"])).abs().max().item()
    param = max((got["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    return loss, param


def _assert_matches(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} losses: {m}")
    assert got["params"].keys() == ref["params"].keys(), what
    for name, want in ref["params"].items():
        assert got["params"][name].shape == want.shape, (what, name)
        torch.testing.assert_close(got["params"][name], want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")
    loss, param = _max_diff(got, ref)
    print(f"{what}: max |loss diff| {loss:.2e}, max |param diff| {param:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_hf_gpt2_pp2_gpipe_and_1f1b_match_one_process(reference):
    results = run_ranks(2, _pp_modes, timeout_s=300)
    for schedule in PP_MODES:
        for rank in (0, 1):
            got = results[rank][schedule]
            assert got["cuts"] == ["gpt2.transformer.h.1"]   # a GPT2Block boundary
            assert got["stage"] == rank
            held = got["held"]
            assert any(".h.0." in n for n in held) == (rank == 0), held   # a block on each stage
            assert any(".h.1." in n for n in held) == (rank == 1), held
            assert any("ln_f" in n for n in held) == (rank == 1), held
            assert got["interpreted"] == 0   # its generated code runs (pipeline._generated)
            _assert_matches(got, reference, f"{schedule} rank {rank}")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_hf_gpt2_fsdp2_dp_shard2_x_tp2_matches_one_process(reference):
    results = run_ranks(4, _train_fsdp_tp, timeout_s=300)
    assert sorted(r["dp_rank"] for r in results.values()) == [0, 0, 1, 1]
    for rank, got in results.items():
        # the fused q|k|v: FSDP on dim 0 (Conv1D's input features), tp strided on dim 1
        placements, local = got["c_attn"]
        assert "Shard(dim=0)" in placements and "_StridedShard" in placements, placements
        assert local == (16, 48), local
        assert got["kept"] == ["transformer.h.0.attn.c_attn.bias", "transformer.h.1.attn.c_attn.bias"]
        _assert_matches(got, reference, f"fsdp x tp rank {rank}")
