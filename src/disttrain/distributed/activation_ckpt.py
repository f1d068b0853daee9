"""Activation checkpointing (`--grad-ckpt`): trade compute for activation memory.

    from disttrain.distributed.activation_ckpt import enable_grad_ckpt
    how = enable_grad_ckpt(model)          # before wrap(); returns how it was enabled

Activations of the wrapped blocks are dropped after forward and recomputed in backward, so
a model whose activations do not fit trains at the cost of about one extra forward. It is
not a strategy: it works the same under none, ddp and fsdp, so it lives beside them.
"""

from __future__ import annotations

from torch import nn


def enable_grad_ckpt(model: nn.Module) -> str:
    """Turn on activation checkpointing for `model`.

    The model's own switch when it has one (`gradient_checkpointing_enable`, as Hugging
    Face models), else each direct child with parameters is recomputed in backward.
    Non-reentrant, so it works under DDP and FSDP.

    Returns:
        How it was enabled, for the run's notes.
    """
    if hasattr(model, "gradient_checkpointing_enable"):
        # Non-reentrant: transformers 4.x defaulted to reentrant, which under DDP with frozen
        # weights (LoRA) fails "Expected to mark a variable ready only once" (peft#313,
        # accelerate#2017); transformers 5 defaults to non-reentrant already.
        try:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        except TypeError:   # a model whose switch takes no arguments
            model.gradient_checkpointing_enable()
        return "gradient_checkpointing_enable(use_reentrant=False)"
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    blocks = {id(c) for c in _blocks(model)}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in blocks)
    return f"checkpoint_wrapper on {len(blocks)} block(s)"


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's direct children with parameters; a ModuleList or ModuleDict (which has no
    forward of its own: the model calls its items) stands for its items, so a transformer's
    `self.blocks = nn.ModuleList(...)` is checkpointed block by block, not skipped."""
    out: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend(_blocks(child))
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out
