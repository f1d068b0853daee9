"""Checkpoints of the trained part only: a frozen base (LoRA's) is left out of them.

    state = trainable_state(model)                  # the .pt's model entry (DDP, one process)
    load_trainable(model, saved, where)             # resume: onto the freshly loaded base
    options = sharded_options(save_frozen=False)    # FSDP: DCP's state dicts without it

A LoRA fine-tune trains an adapter of a few MB on a base of several GB that never changes:
a checkpoint holding the base would cost the base's size on disk and in write time at every
save, for nothing the run cannot read again from the model directory. A task whose frozen
parameters come back identical from its own loading (`TrainTask.save_frozen=False`: the
recipe with LoRA, whose `load_weights` reads them from `/models` before any resume) gets
checkpoints of the trainable parameters and the buffers, plus everything else a checkpoint
holds (optimizer state, which has no frozen entries anyway, position, RNG). Resume is
strict about what must be there: every trainable key of this model, none of another; a
missing one is named. The saved entry says it left the base out (`FROZEN_LEFT_OUT`), so a
full checkpoint still loads in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.errors import IncompatibleCheckpoint
from disttrain.train.ckpt_compat import state_dict_mismatch

FROZEN_LEFT_OUT = "frozen_left_out"   # .pt entry: how many frozen values the save left out


def frozen_names(model: nn.Module) -> set[str]:
    """State-dict keys of the parameters that do not require a gradient (tied names too)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def trainable_state(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` without its frozen parameters (the buffers stay: a running
    statistic is state the run changes)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def frozen_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def load_trainable(model: nn.Module, saved: Any, where: str, fix: str) -> None:
    """Load a trainable-only model entry into `model` (its frozen parameters already set).

    Raises:
        IncompatibleCheckpoint: a trainable key of this model is missing from the entry, or
            it holds keys or shapes this model does not have (named, with `fix`).
    """
    problem = state_dict_mismatch(trainable_state(model), saved)
    if problem is not None:
        raise IncompatibleCheckpoint(f"resume: {where} (trainable parameters only: the frozen "
                                     f"base is left out) does not fit this model: {problem}; {fix}")
    model.load_state_dict(saved, strict=False)


def sharded_options(save_frozen: bool, **kwargs: Any) -> Any:
    """DCP's state-dict options, frozen parameters left out unless `save_frozen`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=not save_frozen, **kwargs)


def check_sharded_keys(folder: Path, state: Mapping[str, Any], fix: str) -> None:
    """Every model key DCP is about to load is in the folder's metadata; else the missing
    ones are named (DCP would say only the first, inside a traceback of its planner).

    Raises:
        IncompatibleCheckpoint: keys of this model's trainable state are not in the folder.
    """
    import torch.distributed.checkpoint as dcp

    present = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    missing = sorted(k for k in state.get("model", {}) if f"model.{k}" not in present)
    if missing:
        few = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise IncompatibleCheckpoint(f"resume: {folder} lacks {len(missing)} key(s) of this "
                                     f"model's trainable state ({few}); {fix}")


def full_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """FSDP: the consolidated trainable weights on rank 0's CPU ({} elsewhere; a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=sharded_options(False, full_state_dict=True,
                                                               cpu_offload=True))
