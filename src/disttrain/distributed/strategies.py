"""How a model is spread over processes: none | dp | ddp | fsdp.

    name, note = resolve_strategy("ddp", rt)   # world size 1 -> "none": no DDP wrapper
    model = wrap(model, name, rt)               # rt = disttrain.distributed.runtime.setup()
    bare = unwrap(model)                        # the user's module, for saving

A plain dict registry of small functions (Lightning Fabric's strategy axis without the
connector): each takes the bare model on its device and returns the wrapped one.
Comm hooks live in `distributed/comm_hooks.py`, FSDP in `distributed/fsdp.py`, activation
checkpointing (a memory switch that works under every strategy) in
`distributed/activation_ckpt.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrain.distributed.runtime import Runtime
from disttrain.errors import StrategyError
from disttrain.spec.rules import check_dp_world_size


@dataclass
class WrapOptions:
    """Strategy knobs; defaults are the fast and safe ones (measured in benchmarks/)."""

    # Gradients live inside DDP's buckets: no copy after all-reduce and no re-allocation
    # of gradient memory every step (allocator churn, docs/performance.md).
    gradient_as_bucket_view: bool = True
    # None = torch's 25 MB: one bucket, so one all-reduce per step, for models this size
    # (gloo's per-call cost is ~1-1.5 ms on the CPU test machine, docs/performance.md).
    bucket_cap_mb: float | None = None
    static_graph: bool = False
    find_unused_parameters: bool = False
    fsdp_sharding: str = "full"
    fsdp_min_params: int = 100_000
    # Module classes FSDP makes one unit of per instance (a task's transformer block); None:
    # units chosen by size (fsdp_min_params).
    fsdp_unit_types: tuple[type, ...] | None = None
    # FSDP's counterpart of the fp16/bf16 DDP comm hooks: the dtype gradients are reduced in.
    fsdp_reduce_dtype: torch.dtype | None = None
    # FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in host memory.
    fsdp_cpu_offload: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


Wrapper = Callable[[nn.Module, Runtime, WrapOptions], nn.Module]
STRATEGIES: dict[str, Wrapper] = {}


def register(name: str) -> Callable[[Wrapper], Wrapper]:
    def deco(fn: Wrapper) -> Wrapper:
        STRATEGIES[name] = fn
        return fn

    return deco


def dp_gpu_count(rt: Runtime) -> int:
    """GPUs DataParallel would use in this process (0 on CPU)."""
    return torch.cuda.device_count() if rt.device.type == "cuda" else 0


def resolve_strategy(requested: str, rt: Runtime) -> tuple[str, str | None]:
    """The strategy that will really run, and a note when it differs from `requested`.

    - ddp / fsdp with world size 1: `none`. A one-rank DDP still pays for its reducer
      and an all-reduce every step (~0.3 ms/step measured) for nothing.
    - dp with fewer than 2 GPUs: `none` (DataParallel over one device is the model).

    Raises:
        StrategyError: dp in a multi-process job (DP is single-process by design).
    """
    if requested not in STRATEGIES:
        raise StrategyError(f"unknown strategy {requested!r}; choose one of {', '.join(STRATEGIES)}")
    if requested == "dp":
        check_dp_world_size(rt.world_size)
        n = dp_gpu_count(rt)
        if n < 2:
            return "none", (f"strategy dp: {n} GPU(s) visible, DataParallel needs at least 2; "
                            f"running as strategy none")
        return "dp", None
    if requested in ("ddp", "fsdp") and rt.world_size == 1:
        return "none", (f"strategy {requested}: world size 1, so no wrapper and no all-reduce "
                        f"(running as strategy none)")
    return requested, None


@register("none")
def _wrap_none(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    return model


@register("dp")
def _wrap_dp(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    n = dp_gpu_count(rt)
    if n < 2:
        return model
    return nn.DataParallel(model, device_ids=list(range(n)), output_device=rt.device.index or 0)


@register("ddp")
def _wrap_ddp(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    if not rt.distributed:
        raise RuntimeError("strategy 'ddp' needs a process group: call disttrain.distributed.runtime.setup()")
    kwargs: dict[str, Any] = {
        "gradient_as_bucket_view": opts.gradient_as_bucket_view,
        "static_graph": opts.static_graph,
        "find_unused_parameters": opts.find_unused_parameters,
        **opts.extra,
    }
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    if rt.device.type == "cuda":
        # device_ids only on CUDA: on CPU DDP rejects them (a common porting mistake).
        kwargs["device_ids"] = [rt.device.index]
        kwargs["output_device"] = rt.device.index
    return DDP(model, **kwargs)


@register("fsdp")
def _wrap_fsdp(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    from disttrain.distributed.fsdp import wrap_fsdp

    return wrap_fsdp(model, rt, opts.fsdp_sharding, opts.fsdp_min_params, opts.fsdp_reduce_dtype,
                     unit_types=opts.fsdp_unit_types, cpu_offload=opts.fsdp_cpu_offload)


def wrap(model: nn.Module, strategy: str, rt: Runtime, opts: WrapOptions | None = None) -> nn.Module:
    """Move `model` to this rank's device and wrap it for `strategy`.

    Args:
        model: the bare module.
        strategy: a key of STRATEGIES ("none", "dp", "ddp", "fsdp"); see
            `resolve_strategy` for the one to use on this runtime.
        rt: the runtime from `disttrain.distributed.runtime.setup()`.
        opts: strategy knobs.

    Returns:
        The module to train (call `unwrap` to get the bare one back).

    Example:
        >>> model = wrap(SimpleNet(), "ddp", rt)
    """
    if strategy not in STRATEGIES:
        raise StrategyError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not any(p.is_meta for p in model.parameters()):  # on meta: FSDP2 shards it first, the
        model = model.to(rt.device)                       # values come after (recipes/load_once.py)
    return STRATEGIES[strategy](model, rt, opts or WrapOptions())


def is_fsdp(model: nn.Module) -> bool:
    from disttrain.distributed.fsdp import is_fsdp as _is_fsdp

    return _is_fsdp(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / FSDP1 wrappers (FSDP2 is in place)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(model, (DDP, nn.DataParallel, FullyShardedDataParallel)):
        model = model.module
    return model


def eval_module(model: nn.Module) -> nn.Module:
    """What to call for evaluation: the bare module under DDP (no reducer bookkeeping),
    the wrapper itself for DP and FSDP (they must scatter / gather parameters)."""
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """Skip the gradient reduction when `skip` (accumulation micro-steps), else nothing.

    DDP: `no_sync()`; FSDP: no reduce-scatter (FSDP2 `set_requires_gradient_sync`).
    """
    if not skip:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        from disttrain.distributed.fsdp import fsdp_no_sync

        with fsdp_no_sync(model):
            yield
    else:
        yield


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The full, unsharded state_dict of the bare model (for FSDP a collective)."""
    if is_fsdp(model):
        from disttrain.distributed.fsdp import full_state_dict

        return full_state_dict(model)
    return unwrap(model).state_dict()
