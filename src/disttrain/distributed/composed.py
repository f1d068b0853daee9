"""Data parallel on top of tensor / pipeline parallel (issue 26 item 4): FSDP2 x TP, and
replicas of a tp model or a pipeline stage whose gradients are averaged.

    apply_tp(model, mesh["tp"], plan)                       # tp first (torchtitan's order)
    kept = fully_shard_tp(model, mesh["dp_shard"], Block)   # then FSDP2 over the dp ranks
    ... backward ...
    average_grads(kept, mesh["dp_shard"].get_group())       # what FSDP left to us

    average_grads(stage_params, dp_group)                   # pp x dp, ddp x tp: every gradient

FSDP2 over a tp model shards each tp-local tensor again over the dp ranks and describes the
result as one 2-D DTensor. For a tp weight split by plain `Shard(0)` that is
`(_StridedShard(0, split_factor=tp), Shard(0))`, which DTensor and torch.distributed.checkpoint
understand. A fused q|k|v weight (`FusedColwiseParallel`, `_StridedShard(0, split_factor=3)`
on tp: each rank holds its slice of q, of k and of v) is not: FSDP's dim-0 chunk of the
tp-local `[q_r; k_r; v_r]` cuts through a part (dp rank 0 gets q_r and half of k_r), a
layout no placement pair describes, and FSDP still labels it
`(_StridedShard(0, sf=tp), _StridedShard(0, sf=3))`; `full_tensor()` of that returns rows in
the wrong order, and zeros (measured on torch 2.13: the cause of "the gathered fused qkv rows
come out in the wrong order"). Training itself is right (FSDP all-gathers the same chunks it
cut), which is why the losses matched one process. So here:

- a fused weight with 2 or more dims is sharded by FSDP along another dim than tp's (its
  input features: dim 1 of a Linear, dim 0 of GPT2's transposed Conv1D; `shard_placement_fn`,
  FSDP2 shards any dim since torch 2.6): `(Shard(1), _StridedShard(0, sf=3))` shards two
  different dims, which `full_tensor()` gathers
  correctly, and `tensor_parallel.dcp_view` splits into three evenly sharded parts for DCP;
- a fused bias (1-D: no other dim) stays out of FSDP (`ignored_params`, torch >= 2.7), so it
  stays a tp DTensor replicated over the dp ranks, and its gradient is averaged over them
  by `average_grads` before the optimizer step. It is 3 x width values per block.

Why the replicas average their gradients with one all-reduce per optimizer step instead of
a DDP wrapper: a pipeline stage from torch's tracing frontend is a GraphModule that keeps
unused copies of tied weights (DDP would need `find_unused_parameters`) and a DDP wrapper
renames every parameter under `module.` (the checkpoint's names), and the Trainer runs
several schedule steps per optimizer step under gradient accumulation, where DDP would
reduce after each. torch's own stage does the same as here for a DDP submodule: no_sync on
every micro-batch, one reduction at the last (`_PipelineStageBase.backward_maybe_with_nosync`).
The cost is no overlap of that all-reduce with the backward (a DDP feature); the bytes are
DDP's: 2 (d-1)/d x the stage's (or the tp shard's) gradient bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["average_grads", "fully_shard_tp", "fused_tp"]


def fused_tp(p: torch.Tensor) -> bool:
    """A tp-strided tensor (`FusedColwiseParallel`'s fused q|k|v) that FSDP must not shard
    along the same dim."""
    return isinstance(p, DTensor) and any(isinstance(q, _StridedShard) for q in p.placements)


def fully_shard_tp(model: nn.Module, dp_mesh: DeviceMesh, unit_types: tuple[type, ...] | None,
                   gloo: bool, reduce_dtype: torch.dtype | None = None) -> list[nn.Parameter]:
    """FSDP2 over a tp-parallelized `model`: one unit per `unit_types` instance (a
    transformer block) plus the root, over `dp_mesh`; gradients reduced in `reduce_dtype`
    (`--comm-hook bf16` / `fp16`, as `wrap_fsdp` does; None: the parameters' dtype).

    Returns:
        The parameters FSDP leaves alone (fused 1-D biases, see the module docstring):
        the caller averages their gradients over the dp group before each optimizer step.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from disttrain.distributed.fsdp import retire_gloo_collectives

    kept = [p for p in model.parameters() if fused_tp(p) and p.ndim < 2]

    def placement(p: nn.Parameter) -> Shard:
        if not fused_tp(p):
            return Shard(0)
        taken = {q.dim for q in p.placements if isinstance(q, (Shard, _StridedShard))}
        return Shard(next(d for d in range(p.ndim) if d not in taken))   # GPT2's Conv1D: dim 0

    extra: dict[str, Any] = {"shard_placement_fn": placement, "ignored_params": set(kept),
                             "mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}
    units = [m for m in model.modules() if unit_types and isinstance(m, unit_types) and m is not model]
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, **extra)
    fully_shard(model, mesh=dp_mesh, **extra)
    if gloo:
        retire_gloo_collectives(model)
    return kept


def average_grads(params: Sequence[nn.Parameter], group: Any) -> None:
    """Average each parameter's gradient over `group` (the data-parallel ranks holding the
    same copy): one all-reduce of all of them flattened, in parameter order (the same on
    every replica). A DTensor's gradient is averaged through its local shard. Parameters
    without a gradient are skipped: every replica runs the same graph, so the same ones."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in (p.grad for p in params):
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():   # insertion order: the same on every replica
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)
