"""Tensor parallel with torch's own parts: DTensor `parallelize_module` and a plan per shape.

    plan = tp_plan_for(model, task.tp_plan)      # the task's own, else one matched by names
    check_heads(model, tp=2)                     # StrategyError when 2 does not divide the heads
    apply_tp(model, mesh["tp"], plan)            # parameters become DTensor shards, in place
    full = full_state_dict(model)                # gathered to full tensors (compare, save)

A plan is what Megatron-style TP does to a transformer block (torch tutorial "Large Scale
Transformer model training with Tensor Parallel"; reference:
../shared/reference/cluster-fit-and-scale.md §4): the first Linear of a pair is split by
output features (`ColwiseParallel`), the second by input features (`RowwiseParallel`), so
each pair needs one all-reduce forward and one backward; attention splits by heads (q/k/v
colwise, the output projection rowwise). Parameters outside the plan (embeddings, norms,
the head here) stay whole on every rank and get the same gradient on each, because the
rowwise all-reduce hands every rank the same activations.

A plan is either a mapping `{"module.path.*": ParallelStyle}` (torch's own form, `*`
matches one level) or a callable `plan(model, tp_mesh) -> None` that parallelizes in place
(Lightning Fabric's `parallelize_fn`, for anything a mapping cannot say). Built in:
- chargpt-shaped models (`blocks.N.qkv` fused q/k/v, `proj`, `mlp.0`/`mlp.2`): the fused
  projection is split per part (`FusedColwiseParallel`) so every rank holds whole heads;
- Hugging Face Llama/Qwen2/Mistral decoder layers (`model.layers.N.self_attn.q_proj` ...),
  the names of transformers' own `base_model_tp_plan`;
- Hugging Face GPT2 blocks (`transformer.h.N.attn.c_attn` ..., `Conv1D` projections):
  `disttrain.distributed.tp_plans.gpt2_plan`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from disttrain.distributed.tp_plans import FusedColwiseParallel, gpt2_plan
from disttrain.errors import StrategyError

__all__ = ["FusedColwiseParallel", "TPPlan", "apply_tp", "chargpt_plan", "check_heads", "dcp_view",
           "full_state_dict", "heads_of", "is_tp", "llama_plan", "tp_plan_for"]

TPPlan = Mapping[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], None]
# attributes that hold a head count (chargpt's Block, HF configs and attention modules)
HEAD_ATTRS = ("heads", "n_head", "num_heads", "num_attention_heads", "num_key_value_heads")


def chargpt_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """disttrain.examples.chargpt's blocks: heads split over the tp ranks, the MLP pair
    colwise then rowwise; each block's `heads` becomes the local count."""
    parallelize_module(model, tp_mesh, {
        "blocks.*.qkv": FusedColwiseParallel(3),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
    })
    for block in model.blocks:  # type: ignore[union-attr]
        block.heads //= tp_mesh.size()


def llama_plan(prefix: str = "model.layers.*") -> dict[str, ParallelStyle]:
    """Hugging Face Llama-family decoder layers (Llama, Qwen2, Mistral share the names);
    their attention reshapes with -1 heads, so no attribute needs changing."""
    col, row = ColwiseParallel, RowwiseParallel
    return {f"{prefix}.self_attn.q_proj": col(), f"{prefix}.self_attn.k_proj": col(),
            f"{prefix}.self_attn.v_proj": col(), f"{prefix}.self_attn.o_proj": row(),
            f"{prefix}.mlp.gate_proj": col(), f"{prefix}.mlp.up_proj": col(),
            f"{prefix}.mlp.down_proj": row()}


def _has(model: nn.Module, pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name, _ in model.named_modules())


def tp_plan_for(model: nn.Module, own: TPPlan | None = None) -> TPPlan:
    """The task's own plan, else the built-in plan whose module names the model has.

    Raises:
        StrategyError: no plan given and none matches; names what to give.
    """
    if own is not None:
        return own
    if _has(model, "blocks.*.qkv") and _has(model, "blocks.*.mlp.2"):
        return chargpt_plan
    if _has(model, "model.layers.*.self_attn.q_proj"):
        return llama_plan()
    if _has(model, "transformer.h.*.attn.c_attn") or _has(model, "h.*.attn.c_attn"):
        return gpt2_plan
    raise StrategyError(f"tensor parallel: no built-in plan fits {type(model).__name__} (known: "
                    f"chargpt blocks, Hugging Face Llama/Qwen2/Mistral/GPT2 layers); give the task a "
                    f"tp_plan: {{'module.path': ColwiseParallel(), ...}} or a function "
                    f"(model, tp_mesh) -> None (docs/strategies.md)")


def heads_of(model: nn.Module) -> dict[str, int]:
    """Every head count the model states: `where.attr -> count` (modules and HF config)."""
    found: dict[str, int] = {}
    config = getattr(model, "config", None)
    for owner, obj in [("config", config), *model.named_modules()]:
        for attr in HEAD_ATTRS:
            value = getattr(obj, attr, None) if obj is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found[f"{owner or type(model).__name__}.{attr}"] = value
    return found


def check_heads(model: nn.Module, tp: int) -> None:
    """Refuse a tp degree that does not divide every head count (each rank holds whole heads).

    Raises:
        StrategyError: one line naming the degree and the head count.
    """
    for where, heads in heads_of(model).items():
        if heads % tp:
            raise StrategyError(f"parallelism.tp: {tp} does not divide the model's {heads} heads "
                            f"({where}); use a tp degree that divides {heads}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Parallelize `model` in place over `tp_mesh` with `plan`; returns the model."""
    if callable(plan) and not isinstance(plan, Mapping):
        plan(model, tp_mesh)
    else:
        parallelize_module(model, tp_mesh, dict(plan))
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict with every DTensor gathered to its full tensor (a collective on the
    tp group: every rank calls it), on CPU."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().cpu()
    return out


def is_tp(model: nn.Module) -> bool:
    """Any parameter is a DTensor (TP or FSDP2): a plain per-rank comparison would misread it."""
    return dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())


def dcp_view(state: Any) -> Any:
    """`state` (a model / optimizer state dict, nested) as torch.distributed.checkpoint can
    store it: each strided-sharded DTensor (`FusedColwiseParallel`'s fused q/k/v) becomes one
    evenly sharded DTensor per part, `name.part0` ...; everything else is unchanged.

    DCP describes a rank's piece of a tensor as one contiguous block (offsets + sizes), and
    a strided shard is `parts` blocks, so saving it directly fails ("overlapping chunks").
    The parts are views of the local tensors: `dcp.load(dcp_view(state))` loads in place.
    On a 2-D mesh (FSDP2 x TP) the tp placement is the last one and FSDP shards another dim
    of a fused weight (`composed.fully_shard_tp`), so each part is `(Shard(1), Shard(0))`;
    FSDP's own `_StridedShard` on the dp dim of a plain colwise weight is DCP's to handle.
    """
    if not isinstance(state, dict):
        return state
    out: dict[Any, Any] = {}
    for key, value in state.items():
        placements = list(getattr(value, "placements", ()))
        last = placements[-1] if placements else None
        if isinstance(value, DTensor) and isinstance(last, _StridedShard):
            out.update(_parts(key, value, last))
        else:
            out[key] = dcp_view(value)
    return out


def _parts(key: str, value: DTensor, strided: _StridedShard) -> dict[str, DTensor]:
    """The `split_factor` parts of a DTensor whose innermost placement is `strided`: each a
    view of the local tensor, sharded evenly where the whole was strided."""
    dim, parts = strided.dim, strided.split_factor
    others = [p for p in value.placements[:-1] if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if others:
        raise StrategyError(f"checkpoint: {key} is sharded twice along dim {dim} "
                            f"({value.placements}); a fused tp weight must be sharded by FSDP "
                            f"along another dim (disttrain.distributed.composed.fully_shard_tp)")
    shape = list(value.shape)
    shape[dim] //= parts
    stride = torch.empty(shape, device="meta").stride()
    placements = [*value.placements[:-1], Shard(dim)]
    return {f"{key}.part{i}": DTensor.from_local(chunk, value.device_mesh, placements,
                                                 run_check=False, shape=torch.Size(shape),
                                                 stride=stride)
            for i, chunk in enumerate(value.to_local().chunk(parts, dim=dim))}
