"""How a model is spread over processes: none | ddp (| dp | fsdp, see `register`).

    model = wrap(model, "ddp", rt)        # rt = disttrain.runtime.setup()
    bare = unwrap(model)                  # the user's module, for saving

A plain dict registry of small functions (Lightning Fabric's strategy axis without the
connector): each takes the bare model on its device and returns the wrapped one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrain.runtime import Runtime


@dataclass
class WrapOptions:
    """Strategy knobs; defaults are the fast and safe ones (measured in benchmarks/)."""

    # Gradients live inside DDP's buckets: no copy after all-reduce and no re-allocation
    # of gradient memory every step (the allocator churn perf-baseline.md measured).
    gradient_as_bucket_view: bool = True
    # One bucket for small models: a single all-reduce per step (gloo's per-call cost is
    # ~1-1.5 ms on this machine whatever the size up to ~2 MB).
    bucket_cap_mb: float | None = None
    static_graph: bool = False
    find_unused_parameters: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


Wrapper = Callable[[nn.Module, Runtime, WrapOptions], nn.Module]
STRATEGIES: dict[str, Wrapper] = {}


def register(name: str) -> Callable[[Wrapper], Wrapper]:
    def deco(fn: Wrapper) -> Wrapper:
        STRATEGIES[name] = fn
        return fn

    return deco


@register("none")
def _wrap_none(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    return model


@register("ddp")
def _wrap_ddp(model: nn.Module, rt: Runtime, opts: WrapOptions) -> nn.Module:
    if not rt.distributed:
        raise RuntimeError("strategy 'ddp' needs a process group: call disttrain.runtime.setup()")
    kwargs: dict[str, Any] = {
        "gradient_as_bucket_view": opts.gradient_as_bucket_view,
        "static_graph": opts.static_graph,
        "find_unused_parameters": opts.find_unused_parameters,
        **opts.extra,
    }
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    if rt.device.type == "cuda":
        # device_ids only on CUDA: on CPU DDP rejects them (seed 002's pitfall).
        kwargs["device_ids"] = [rt.device.index]
        kwargs["output_device"] = rt.device.index
    return DDP(model, **kwargs)


def wrap(model: nn.Module, strategy: str, rt: Runtime, opts: WrapOptions | None = None) -> nn.Module:
    """Move `model` to this rank's device and wrap it for `strategy`.

    Args:
        model: the bare module.
        strategy: a key of STRATEGIES ("none", "ddp", ...).
        rt: the runtime from `disttrain.runtime.setup()`.
        opts: strategy knobs.

    Returns:
        The module to train (call `unwrap` to get the bare one back).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    model = model.to(rt.device)
    return STRATEGIES[strategy](model, rt, opts or WrapOptions())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel wrappers."""
    while isinstance(model, (DDP, nn.DataParallel)):
        model = model.module
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """DDP's no_sync() when `skip` (accumulation micro-steps), else nothing."""
    if skip and isinstance(model, DDP):
        with model.no_sync():
            yield
    else:
        yield


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of all parameters and buffers in state_dict order (same on synced ranks)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in unwrap(model).state_dict().items():
        h.update(name.encode())
        if isinstance(t, torch.Tensor):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
