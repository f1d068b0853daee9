"""Batches of any structure: move them to the device, count their samples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a batch (tensors, tuples, lists, dicts, nested) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        try:
            return type(batch)(moved)   # keep the user's mapping type where it allows
        except Exception:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):   # a namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values: Sequence[Any] | Any = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for v in values:
            n = batch_size_of(v)
            if n:
                return n
    return 1
