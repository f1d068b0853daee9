"""FSDP for the Trainer: FSDP2 `fully_shard` where torch has it, else FSDP1.

    model = wrap_fsdp(model, rt, sharding="full", min_params=100_000)
    with fsdp_no_sync(model): ...                      # accumulation micro-steps

FSDP is for models that do not fit one GPU: parameters, gradients and
optimizer state are sharded over ranks and gathered per unit around its forward and
backward. Units are chosen by size, like torch's `size_based_auto_wrap_policy`: every
submodule holding at least `min_params` parameters not already in a smaller unit gets
its own unit, the root takes the rest. Sharding modes (`--fsdp-sharding`):

- full: shard over all ranks (ZeRO-3);
- hybrid: shard inside a node, replicate across nodes (HSDP: all-gathers stay on the
  fast intra-node links); with one node it is the same as full;
- none: replicate everywhere (DDP-like), still with FSDP's checkpoints.

Works with gloo on CPU (how the tests run it) and NCCL on GPUs; on gloo each all-gather and
reduce-scatter returns once gloo's worker thread has let go of its tensors
(`retire_gloo_collectives`), so a run's memory is the same every time, as on NCCL.
`cpu_offload` keeps shards, gradients and optimizer state in host memory (FSDP2's
CPUOffloadPolicy, `--cpu-offload`). Checkpoints of a sharded
model (`torch.distributed.checkpoint` folders, each rank writing its own shards) are
written by `disttrain.train.checkpoint`. `envvars.FSDP_VERSION` set to 1 forces FSDP1
(tests use it).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain import envvars
from disttrain.distributed.runtime import Runtime
from disttrain.errors import StrategyError

SHARDING = ("full", "hybrid", "none")
DEFAULT_MIN_PARAMS = 100_000


def _fully_shard() -> Any | None:
    """torch's fully_shard (public since 2.6, `_composable` in 2.4-2.5), or None."""
    if envvars.fsdp1_forced():
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
            raise StrategyError(f"fsdp_sharding hybrid needs the same number of processes on "
                                f"every node (world size {world_size}, {local_world_size} local)")
        return (world_size // local_world_size, local_world_size)
    raise StrategyError(f"unknown fsdp_sharding {sharding!r}; choose one of {', '.join(SHARDING)}")


def _mesh(rt: Runtime, sharding: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(rt.world_size, rt.env.local_world_size, sharding)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    # The mesh reads its rank table's values: made on real tensors also when the model is
    # traced on fake ones (`disttrain plan`, plan/trace.py).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return init_device_mesh(rt.device.type, shape, mesh_dim_names=names)


def wrap_fsdp(model: nn.Module, rt: Runtime, sharding: str = "full",
              min_params: int = DEFAULT_MIN_PARAMS, reduce_dtype: torch.dtype | None = None,
              unit_types: tuple[type, ...] | None = None, cpu_offload: bool = False) -> nn.Module:
    """Shard `model` (already on rt.device) over the process group.

    Args:
        model: the bare module.
        rt: the runtime (a live process group).
        sharding: full | hybrid | none.
        min_params: size threshold of an FSDP unit.
        reduce_dtype: dtype gradients are reduced in (bf16/fp16 halve the bytes, the
            FSDP counterpart of DDP's compression hooks); None = the parameters' dtype.
        unit_types: module classes to make one FSDP unit of per instance (a transformer
            block: one all-gather per block, freed after its forward); None = by size.
        cpu_offload: keep the shards, their gradients and the optimizer state in host
            memory (FSDP2's CPUOffloadPolicy; pinned when the device is a GPU): the device
            holds only the units being gathered, the optimizer steps on the CPU.

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
        extra: dict[str, Any] = {}
        if cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            # pinning needs an accelerator: torch refuses pin_memory on a CPU-only host
            extra["offload_policy"] = CPUOffloadPolicy(pin_memory=rt.device.type == "cuda")
        reshard = sharding != "none"
        units = ([m for m in model.modules() if isinstance(m, unit_types) and m is not model]
                 if unit_types else size_based_units(model, min_params))
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, **extra)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, **extra)
        if rt.backend == "gloo":
            retire_gloo_collectives(model)
        return model
    if cpu_offload:
        raise StrategyError("train.cpu_offload needs FSDP2 (torch >= 2.4, fully_shard); this "
                            "run uses FSDP1: drop --cpu-offload, or unset the FSDP1 override")
    return _wrap_fsdp1(model, rt, sharding, min_params, reduce_dtype, mesh, unit_types)


# --comm-hook fp16 / bf16 under FSDP: the dtype gradients are reduced in (DDP's hooks'
# counterpart; FSDP has no comm hook)
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def cpu_offloaded(model: nn.Module) -> bool:
    """True when `model` is an FSDP2 model wrapped with CPU offload (`wrap_fsdp(cpu_offload=
    True)`). Read from FSDP2's own state (private fields, so a torch that moves them answers
    False); on a GPU the parameters' device tells the same, on the CPU nothing else does."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
        except (AttributeError, AssertionError):
            return False
        if group is not None:   # a root whose parameters all sit in its units has none
            return type(getattr(group, "offload_policy", None)).__name__ == "CPUOffloadPolicy"
    return False


def retire_gloo_collectives(model: nn.Module) -> bool:
    """Make every FSDP2 unit's all-gather and reduce-scatter return only once gloo has let
    go of the collective's tensors, so a buffer FSDP drops is freed there and then.

    ProcessGroupGloo runs a collective on a worker thread that holds the work (and with it
    the output and input tensors) until after `execute` returns, while `wait()` returns as
    soon as the work is marked done (`ProcessGroupGloo::runLoop`: `work->execute();
    lock.lock(); workInProgress_[i].reset();` and the loop's own reference). When the main
    thread is faster, FSDP's `all_gather_result = None` (or the reduce-scatter input it pops)
    no longer frees the buffer: the worker does, whenever it next gets the GIL. How many
    units' buffers are alive at the peak then moves from run to run (measured 1.0-1.23x the
    prompt-release figure), while NCCL releases them in `wait()` on the main thread. Here
    each collective is issued on fresh views of its tensors, whose Python objects torch
    keeps alive exactly as long as the work holds their TensorImpls; the call waits (GIL
    released) until the weak references die, i.e. the work is destroyed.

    The reduce-scatter is gloo's own algorithm without its private buffer:
    `ProcessGroupGloo::reduce_scatter_tensor_coalesced` all-reduces `input.clone()` and
    copies this rank's chunk out, and that clone, a full-size buffer no view of ours
    reaches, died on `pt_gloo_runloop` after the call in about 1 run in 5 (+7% on a
    two-layer model's peak). `InPlaceReduceScatter` all-reduces FSDP's input buffer itself,
    which FSDP discards after the collective. The run's memory is then what FSDP itself
    keeps, the figure `disttrain plan` traces (docs/memory.md).

    Returns:
        True when installed; False on a torch without custom FSDP2 comms (before 2.8) or an
        FSDP1 model, which keep the worker's timing.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return False
    units = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    if not units:
        return False

    class RetiredAllGather(DefaultAllGather):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, async_op: bool = False) -> Any:
            return _retired(lambda out, inp: dist.all_gather_single(
                out, inp, group=group, async_op=True), (output_tensor, input_tensor), async_op)

    class InPlaceReduceScatter(DefaultReduceScatter):  # type: ignore[misc, valid-type]
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, op: Any, async_op: bool = False) -> Any:
            # gloo's own reduce-scatter all-reduces a clone of the input and copies this
            # rank's chunk out; FSDP drops its input buffer after the collective, so the
            # same all-reduce runs on the buffer itself: the same bytes on the wire, one
            # full-size clone less (freed by gloo's worker whenever it ran: the rest of the
            # run-to-run spread in a gloo FSDP run's peak)
            work = _retired(lambda inp: dist.all_reduce(
                inp, op=op, group=group, async_op=True), (input_tensor,), async_op)
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            output_tensor.copy_(input_tensor.view(world, -1)[rank].view(output_tensor.shape))
            return work

    for unit in units:
        unit.set_custom_all_gather(RetiredAllGather())
        unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    return True


RETIRE_WAIT_S = 10.0   # a worker that holds a finished work longer is left to free it itself


def _retired(issue: Any, tensors: tuple[torch.Tensor, ...], async_op: bool) -> Any:
    """Issue a collective on fresh views of `tensors`; wait for it and for gloo's worker to
    destroy the work (see `retire_gloo_collectives`). An async caller gets a finished
    work."""
    views = [t.view(t.shape) for t in tensors]
    alive = [weakref.ref(v) for v in views]
    work = issue(*views)
    del views
    work.wait()
    if async_op:
        return work   # the caller holds the work: its tensors live until it drops it
    del work
    deadline = time.monotonic() + RETIRE_WAIT_S
    while any(ref() is not None for ref in alive) and time.monotonic() < deadline:
        time.sleep(0.0001)
    return None


def _wrap_fsdp1(model: nn.Module, rt: Runtime, sharding: str, min_params: int,
                reduce_dtype: torch.dtype | None, mesh: Any,
                unit_types: tuple[type, ...] | None = None) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    strategy = {"full": ShardingStrategy.FULL_SHARD, "hybrid": ShardingStrategy.HYBRID_SHARD,
                "none": ShardingStrategy.NO_SHARD}[sharding]
    kwargs: dict[str, Any] = {}
    if sharding == "hybrid":
        kwargs["device_mesh"] = mesh
    if reduce_dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(reduce_dtype=reduce_dtype)
    policy: Any = (ModuleWrapPolicy(set(unit_types)) if unit_types else
                   functools.partial(size_based_auto_wrap_policy, min_num_params=min_params))
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy,
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
