"""Tensor-parallel plans for Hugging Face GPT2-style models, whose projections are `Conv1D`.

    plan = tp_plan_for(model)            # gpt2_plan when the model has transformer.h.N.attn.c_attn
    apply_tp(model, mesh["tp"], plan)    # c_attn/c_fc split by output, c_proj by input

transformers' `Conv1D` is a Linear with its weight stored transposed (`(in, out)`, forward
`addmm(bias, x, weight)`), and torch's `ColwiseParallel` / `RowwiseParallel` accept only
`nn.Linear` and `nn.Embedding` (they raise NotImplementedError otherwise). Rather than swap
the modules for Linears (which would transpose every saved weight away from the layout
`save_pretrained` and the Hub checkpoints use), the two styles here shard a Conv1D along the
transposed dimensions: colwise = weight `Shard(1)` + bias `Shard(0)`, rowwise = weight
`Shard(0)` + bias `Replicate()`; the forward stays Conv1D's own, run on DTensors, so the
collectives are the ones torch's styles issue (one all-reduce forward, one backward, per pair).
`c_attn` holds q | k | v side by side, so it is split per part like chargpt's fused qkv
(`_StridedShard`, see `FusedColwiseParallel`): each rank holds whole heads of all three.

GPT2Attention splits c_attn's output with `split_size` (the full width) and reshapes with -1
heads, so the plan sets `split_size` and `num_heads` to the local values after sharding.
Module names: `transformer.h.N.attn`, `transformer.h.N.mlp` (`h.N...` for a bare GPT2Model).
Embeddings, layer norms and the (tied) head stay whole on every rank.

`gpt2_sequence_parallel_plan()` adds sequence parallel for the layer norms and a
vocabulary-split embedding and head; `gpt2_sequence_parallel_plan(loss_parallel=True)`
keeps the logits split by vocabulary for a loss computed under torch's `loss_parallel()`
(a task's own tp_plan: the built-in Trainer computes its loss outside that context).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from disttrain.errors import StrategyError

__all__ = [
    "GPT2_BLOCKS",
    "Conv1DColwiseParallel",
    "Conv1DRowwiseParallel",
    "FusedColwiseParallel",
    "gpt2_plan",
    "gpt2_sequence_parallel_plan",
    "is_conv1d",
]

GPT2_BLOCKS = "transformer.h.*"


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT2, GPT, ...), recognised without importing transformers: a
    module with `nf`/`nx` and a weight of shape (nx, nf)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, nn.Parameter)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def _strided(param: nn.Parameter, dim: int, parts: int, mesh: DeviceMesh, where: str) -> nn.Parameter:
    """`param` split along `dim` into `parts` blocks side by side, each block sharded over
    the mesh: rank r holds [part0_r, part1_r, ...] (whole heads of q, k and v)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    full = distribute_tensor(param.detach(), mesh, [Replicate()]).to_local()  # rank 0's values
    if full.shape[dim] % (parts * size):
        raise StrategyError(f"tensor parallel: {where} has {full.shape[dim]} output features, not "
                            f"divisible into {parts} parts x tp={size}")
    rows = full.shape[dim] // (parts * size)
    moved = full.movedim(dim, 0)
    local = moved.reshape(parts, size, rows, *moved.shape[1:])[:, rank].reshape(
        parts * rows, *moved.shape[1:]).movedim(0, dim).contiguous()
    placement = _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)
    shard = DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                               stride=full.stride())
    return nn.Parameter(shard, requires_grad=param.requires_grad)


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is `parts` projections side by side
    (q, k, v in one `qkv` Linear): each rank gets its slice of every part, so its local
    output is `[q_r, k_r, v_r]` and `.chunk(parts, -1)` gives whole heads. A plain Shard(0)
    would hand rank 0 all of q and half of k. The weight is a DTensor with torch's strided
    placement (`_StridedShard(0, split_factor=parts)`, what FSDP2 x TP uses), so
    `full_tensor()` and the optimizer see the true layout."""

    def __init__(self, parts: int = 3, **kwargs: Any):
        super().__init__(**kwargs)
        self.parts = parts

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: DTensor, device_mesh: DeviceMesh) -> Any:
        # keep the strided layout: ColwiseParallel's would redistribute it to a plain
        # Shard(-1), which moves the rows back to "all of q, then half of k"
        return outputs.to_local() if use_local_output else outputs

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, _strided(param, 0, self.parts, device_mesh,
                                                      f"{name}.{pname}"))


class Conv1DColwiseParallel(FusedColwiseParallel):
    """ColwiseParallel for a Conv1D: output features are weight dim 1 and bias dim 0.
    `parts` > 1: the output is that many projections side by side (GPT2's c_attn = q|k|v),
    each split over the ranks (see module docstring)."""

    def __init__(self, parts: int = 1, **kwargs: Any):
        super().__init__(parts, **kwargs)

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, dim in (("weight", 1), ("bias", 0)):
            param = getattr(module, pname, None)
            if param is not None:
                module.register_parameter(pname, _strided(param, dim, self.parts, device_mesh,
                                                          f"{name}.{pname}"))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a Conv1D: input features are weight dim 0; the bias is whole on
    every rank and added once, after the partial sums (DTensor's Partial -> Replicate)."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        module.register_parameter("weight", nn.Parameter(
            distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
            requires_grad=module.weight.requires_grad))
        if getattr(module, "bias", None) is not None:
            module.register_parameter("bias", nn.Parameter(
                distribute_tensor(module.bias, device_mesh, [Replicate()], src_data_rank=self.src_data_rank),
                requires_grad=module.bias.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def gpt2_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """GPT2LMHeadModel / GPT2Model blocks: heads split over the tp ranks (c_attn per part,
    c_proj rowwise), the MLP pair colwise then rowwise; each attention's `num_heads` and
    `split_size` become the local values (its forward splits q|k|v by `split_size`)."""
    tp = tp_mesh.size()
    prefix = GPT2_BLOCKS if hasattr(model, "transformer") else GPT2_BLOCKS.split(".", 1)[1]
    parallelize_module(model, tp_mesh, {
        f"{prefix}.attn.c_attn": Conv1DColwiseParallel(parts=3),
        f"{prefix}.attn.c_proj": Conv1DRowwiseParallel(),
        f"{prefix}.mlp.c_fc": Conv1DColwiseParallel(),
        f"{prefix}.mlp.c_proj": Conv1DRowwiseParallel(),
    })
    _local_heads(model, tp)


def _local_heads(model: nn.Module, tp: int) -> None:
    """Each split GPT2Attention's head count and q|k|v split width, per rank (a block's
    `crossattention`, when the config adds one, is not in the plan and stays whole)."""
    for name, module in model.named_modules():
        if name.endswith(".attn") and hasattr(module, "split_size"):
            module.num_heads //= tp
            module.split_size //= tp
            module.embed_dim //= tp


def gpt2_sequence_parallel_plan(loss_parallel: bool = False) -> Callable[[nn.Module, DeviceMesh], None]:
    """`gpt2_plan` plus sequence parallel (a GPT2LMHeadModel): inside the blocks the
    residual stream is split by sequence over the tp ranks (layer norms run on 1/tp of the
    tokens, `SequenceParallel`), each colwise layer all-gathers its input and each rowwise
    layer reduce-scatters its output (the bytes of the all-reduce they replace; the norms'
    and residuals' activations are 1/tp). The token embedding is split by vocabulary rows
    (one all-reduce of its output), the sequences are whole until the embeddings' dropout
    (GPT2Model numbers positions from its input's length) and whole again after `ln_f`
    (GPT2Model reshapes to the whole sequence's shape); the head, tied to the token
    embedding, is split by vocabulary too and re-tied (both are `Shard(0)`).

    `loss_parallel=True`: the head's logits stay sharded by vocabulary (a DTensor) and the
    caller computes the loss inside `torch.distributed.tensor.parallel.loss_parallel()`
    (forward and backward), so no rank ever holds the full logits; without it the logits
    are gathered, which any loss can read.
    """

    def plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
        if not hasattr(model, "transformer") or not hasattr(model, "lm_head"):
            raise StrategyError("tensor parallel: the sequence-parallel GPT2 plan needs a "
                                "GPT2LMHeadModel (transformer + lm_head); use gpt2_plan")
        tied = model.lm_head.weight is model.transformer.wte.weight
        seq, blocks = Shard(1), GPT2_BLOCKS
        parallelize_module(model, tp_mesh, {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "transformer.drop": PrepareModuleOutput(output_layouts=Replicate(),
                                                    desired_output_layouts=seq),
            f"{blocks}.ln_1": SequenceParallel(use_local_output=True),
            f"{blocks}.attn.c_attn": Conv1DColwiseParallel(parts=3, input_layouts=seq),
            f"{blocks}.attn.c_proj": Conv1DRowwiseParallel(output_layouts=seq),
            f"{blocks}.ln_2": SequenceParallel(use_local_output=True),
            f"{blocks}.mlp.c_fc": Conv1DColwiseParallel(input_layouts=seq),
            f"{blocks}.mlp.c_proj": Conv1DRowwiseParallel(output_layouts=seq),
            "transformer.ln_f": SequenceParallel(),   # a DTensor out: reshaped whole
            "lm_head": ColwiseParallel(input_layouts=seq,
                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel),
        })
        if tied:  # both split by vocabulary rows (Shard(0)): one parameter again
            model.lm_head.weight = model.transformer.wte.weight
        _local_heads(model, tp_mesh.size())

    return plan
