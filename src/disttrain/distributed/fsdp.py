"""FSDP for the Trainer: FSDP2 `fully_shard` where torch has it, else FSDP1; DCP checkpoints.

    model = wrap_fsdp(model, rt, sharding="full", min_params=100_000)
    with fsdp_no_sync(model): ...                      # accumulation micro-steps
    ref = save_sharded(ckpt_dir, step, model, optimizer, rank0=rt.is_rank0)
    load_sharded(ckpt_dir / ref["dcp"], model, optimizer)

Seed 000 §1 lists FSDP for models that do not fit one GPU: parameters, gradients and
optimizer state are sharded over ranks and gathered per unit around its forward and
backward. Units are chosen by size, like torch's `size_based_auto_wrap_policy`: every
submodule holding at least `min_params` parameters not already in a smaller unit gets
its own unit, the root takes the rest. Sharding modes (`--fsdp-sharding`):

- full: shard over all ranks (ZeRO-3);
- hybrid: shard inside a node, replicate across nodes (HSDP: all-gathers stay on the
  fast intra-node links); with one node it is the same as full;
- none: replicate everywhere (DDP-like), still with FSDP's checkpoints.

Works with gloo on CPU (how the tests run it) and NCCL on GPUs. Checkpoints are
`torch.distributed.checkpoint` folders: every rank writes its own shards in parallel,
nobody gathers the whole optimizer state, and the folder loads into any world size. A
consolidated model state_dict is still put in `last.pt` (rank 0) for users who want the
plain weights. Set DISTTRAIN_FSDP_VERSION=1 to force FSDP1 (tests use it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.distributed.runtime import Runtime

SHARDING = ("full", "hybrid", "none")
DEFAULT_MIN_PARAMS = 100_000


def _fully_shard() -> Any | None:
    """torch's fully_shard (public since 2.6, `_composable` in 2.4-2.5), or None."""
    if os.environ.get("DISTTRAIN_FSDP_VERSION") == "1":
        return None
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

        return fully_shard
    except ImportError:
        return None


def fsdp_version() -> int:
    """2 when FSDP2 (`fully_shard`) is used, else 1."""
    return 2 if _fully_shard() is not None else 1


def _fsdp2_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]

            return FSDPModule
        except ImportError:
            return None


def is_fsdp(model: nn.Module) -> bool:
    """True for a model wrapped by FSDP1 or FSDP2."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp2 = _fsdp2_module_type()
    return isinstance(model, FullyShardedDataParallel) or (
        fsdp2 is not None and isinstance(model, fsdp2))


def size_based_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules (not the root) that get their own FSDP unit, innermost first.

    A module becomes a unit when the parameters it holds outside already-chosen units
    number at least `min_params` (torch's size_based_auto_wrap_policy rule).
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and free >= min_params:
            units.append(module)
            return 0
        return free

    visit(model)
    return units


def mesh_shape(world_size: int, local_world_size: int, sharding: str) -> tuple[int, ...]:
    """Device-mesh shape for a sharding mode: (shard,) or (replicate, shard)."""
    if sharding == "full":
        return (world_size,)
    if sharding == "none":
        return (world_size, 1)
    if sharding == "hybrid":
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(f"fsdp_sharding hybrid needs the same number of processes on "
                             f"every node (world size {world_size}, {local_world_size} local)")
        return (world_size // local_world_size, local_world_size)
    raise ValueError(f"unknown fsdp_sharding {sharding!r}; choose one of {', '.join(SHARDING)}")


def _mesh(rt: Runtime, sharding: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(rt.world_size, rt.env.local_world_size, sharding)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(rt.device.type, shape, mesh_dim_names=names)


def wrap_fsdp(model: nn.Module, rt: Runtime, sharding: str = "full",
              min_params: int = DEFAULT_MIN_PARAMS, reduce_dtype: torch.dtype | None = None
              ) -> nn.Module:
    """Shard `model` (already on rt.device) over the process group.

    Args:
        model: the bare module.
        rt: the runtime (a live process group).
        sharding: full | hybrid | none.
        min_params: size threshold of an FSDP unit.
        reduce_dtype: dtype gradients are reduced in (bf16/fp16 halve the bytes, the
            FSDP counterpart of DDP's compression hooks); None = the parameters' dtype.

    Returns:
        The sharded model (FSDP2: the same object; FSDP1: a wrapper).
    """
    if not rt.distributed:
        raise RuntimeError("strategy 'fsdp' needs a process group: call disttrain.setup()")
    mesh = _mesh(rt, sharding)
    fully_shard = _fully_shard()
    if fully_shard is not None:
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy  # type: ignore
        mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        reshard = sharding != "none"
        for unit in size_based_units(model, min_params):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        return model
    return _wrap_fsdp1(model, rt, sharding, min_params, reduce_dtype, mesh)


def _wrap_fsdp1(model: nn.Module, rt: Runtime, sharding: str, min_params: int,
                reduce_dtype: torch.dtype | None, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    strategy = {"full": ShardingStrategy.FULL_SHARD, "hybrid": ShardingStrategy.HYBRID_SHARD,
                "none": ShardingStrategy.NO_SHARD}[sharding]
    kwargs: dict[str, Any] = {}
    if sharding == "hybrid":
        kwargs["device_mesh"] = mesh
    if reduce_dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(reduce_dtype=reduce_dtype)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy,
                                                  min_num_params=min_params),
        sharding_strategy=strategy, use_orig_params=True, device_id=rt.device, **kwargs)


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduce-scatter for accumulation micro-steps (FSDP1 and FSDP2)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def reduced_grad_bytes(model: nn.Module, reduce_dtype: torch.dtype | None) -> int:
    """Gradient bytes FSDP reduces per optimizer step (reduce-scatter input, all units)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            size = torch.empty((), dtype=reduce_dtype or p.dtype).element_size()
            total += p.numel() * size
    return total


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model state_dict (a collective: every rank must call it).

    With rank0_only the gathered tensors land on CPU on rank 0 and other ranks get {}.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return get_model_state_dict(model, options=opts)


# -- checkpoints (torch.distributed.checkpoint) ----------------------------------------
def dcp_name(step: int) -> str:
    return f"dcp-{step:08d}"


def save_sharded(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 rank0: bool, keep: int = 2) -> dict[str, Any]:
    """Every rank writes its shards of model + optimizer to `ckpt_dir/dcp-<step>/`.

    The folder is written under a temporary name and renamed by rank 0 once DCP's
    metadata (written last, after every rank's data) exists, so a crash mid-save never
    leaves a folder that looks complete. Returns what rank 0 puts in last.pt: the folder
    name and the consolidated model weights.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = dcp_name(step)
    tmp = ckpt_dir / f".{name}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
    full = full_state_dict(model, rank0_only=True)
    if rank0:
        final = ckpt_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(ckpt_dir, keep)
    return {"dcp": name, "model": full, "optimizer": {}}


def _prune(ckpt_dir: Path, keep: int) -> None:
    folders = sorted((p for p in ckpt_dir.glob("dcp-*") if p.is_dir()), reverse=True)
    for old in folders[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a `save_sharded` folder into the (already sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: not a complete torch.distributed.checkpoint folder")
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
