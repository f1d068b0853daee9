"""FSDP's checkpoints: each rank's shards in a torch.distributed.checkpoint folder.

    model_and_folder, files = save_sharded(ckpt_dir, step, model, optimizer, rank0)
    load_sharded(ckpt_dir / "dcp-<step>", model, optimizer)

`train/checkpoint.py` writes the .pt file that names the folder (and holds the
consolidated weights) and the manifest that records the folder's files. Tensor and
pipeline parallel runs save through the same folder with their own `ShardedLayout`
(train/model_parallel.py): what each rank puts in it and how it goes back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.errors import CheckpointError
from disttrain.train.ckpt_integrity import Digest, folder_digests, state_nbytes, write_error
from disttrain.train.ckpt_trainable import check_sharded_keys, full_trainable_state, sharded_options


@dataclass
class ShardedLayout:
    """A model + optimizer layout other than FSDP's: `state()` the DCP state dict (its
    tensors views of the live ones, so `dcp.load` fills them in place), `load(state)` puts
    a loaded one back, `full()` the consolidated model weights for the .pt (a collective)."""

    state: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]
    full: Callable[[], dict[str, torch.Tensor]]


def dcp_name(step: int) -> str:
    return f"dcp-{step:08d}"


def save_sharded(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 rank0: bool, layout: ShardedLayout | None = None, save_frozen: bool = True
                 ) -> tuple[dict[str, Any], dict[str, Digest]]:
    """Every rank writes its shards of model + optimizer to `ckpt_dir/dcp-<step>/`.

    Every rank writes its own shards in parallel, nobody gathers the whole optimizer state,
    and the folder loads into any world size. It is written under a temporary name and
    renamed by rank 0 once DCP's metadata (written last, after every rank's data) exists,
    so a crash mid-save never leaves a folder that looks complete. Returns what rank 0
    puts in the .pt file (the folder name and the consolidated model weights) and, on rank
    0, the folder's files for the manifest (read back once by rank 0; on a shared volume
    every rank's shards are there).

    `save_frozen=False`: the frozen parameters (a LoRA base) are left out of the folder and
    of the consolidated weights (train/ckpt_trainable.py).

    Raises:
        CheckpointError: on every rank alike (DCP gathers each rank's failure and raises it
            on all), a full disk named with the bytes needed and free.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from disttrain.distributed.fsdp import full_state_dict

    name = dcp_name(step)
    tmp = ckpt_dir / f".{name}.tmp"
    error = None
    if rank0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = write_error(exc, tmp, 0)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)  # rank 0's verdict, before anyone writes
    if gathered[0]:
        raise CheckpointError(gathered[0])
    if layout is not None:
        state = layout.state()
    else:
        msd, osd = get_state_dict(model, optimizer, options=sharded_options(save_frozen))
        state = {"model": msd, "optimizer": osd}
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as exc:  # a BaseException, raised on every rank
        # Rank 0 cleans up and words the error; the others take its words, so the ranks
        # raise one message. torch.save inside DCP reports a full disk as "unexpected
        # pos" (the OSError is lost in its C++ writer): the free space tells.
        message = None
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            needed = state_nbytes(state) * dist.get_world_size()
            message = write_error(exc, ckpt_dir / name, needed, full=_free(ckpt_dir) < needed)
        dist.all_gather_object(gathered, message)
        raise CheckpointError(gathered[0]) from None
    full = (layout.full() if layout is not None else full_state_dict(model, rank0_only=True)
            if save_frozen else full_trainable_state(model))
    files: dict[str, Digest] = {}
    if rank0:
        final = ckpt_dir / name
        try:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            files = folder_digests(final, name)
        except OSError as exc:  # said to the other ranks by the Checkpointer's closing gather
            raise CheckpointError(write_error(exc, final, 0)) from None
    return {"dcp": name, "model": full, "optimizer": {}}, files


def _free(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 layout: ShardedLayout | None = None, save_frozen: bool = True,
                 fix: str = "") -> None:
    """Load a `save_sharded` folder into the (already sharded) model and optimizer;
    `save_frozen=False`: a folder without the frozen parameters, which keep their values.

    Raises:
        CheckpointError: the folder has no DCP metadata (its save did not finish).
        IncompatibleCheckpoint: a trainable key of the model is not in the folder (named).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{folder}: not a complete torch.distributed.checkpoint folder")
    if layout is not None:
        state = layout.state()
        dcp.load(state, checkpoint_id=str(folder))
        layout.load(state)
        return
    msd, osd = get_state_dict(model, optimizer, options=sharded_options(save_frozen))
    state = {"model": msd, "optimizer": osd}
    if not save_frozen:
        check_sharded_keys(folder, state, fix)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=sharded_options(save_frozen, strict=save_frozen))
