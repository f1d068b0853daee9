"""Tuning pieces of seed 000 §7: LR scaling with the global batch, warm-up, mixed precision.

    lr = scaled_lr(0.001, "linear", batch_size=32, world_size=4, grad_accum=1)   # 0.004
    amp = Precision.create("bf16", device)      # amp.autocast(), amp.scaler
    opt = build_optimizer("adam", model.parameters(), lr)   # fused kernel when available

Mixed precision uses `torch.autocast(device_type=...)` and `torch.amp.GradScaler`, not
the seed's deprecated `torch.cuda.amp` spellings. fp16 needs CUDA (CPU autocast has no
fp16 GEMMs worth having, and a loss scaler is for fp16's narrow range); bf16 runs on CPU
and on Ampere or newer GPUs without a scaler.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.errors import PrecisionError


def global_batch(batch_size: int, world_size: int, grad_accum: int) -> int:
    """Samples per optimizer step over all ranks (seed 000 §7.2)."""
    return batch_size * world_size * grad_accum


def scaled_lr(base_lr: float, rule: str, batch_size: int, world_size: int, grad_accum: int) -> float:
    """Scale the LR by global batch / per-device batch: linear (Goyal et al.) or sqrt."""
    factor = global_batch(batch_size, world_size, grad_accum) / batch_size
    if rule == "linear":
        return base_lr * factor
    if rule == "sqrt":
        return base_lr * math.sqrt(factor)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown lr_scaling {rule!r}; choose linear, sqrt or none")


def warmup_lambda(warmup_steps: int):
    """Linear warm-up from 1/warmup_steps to 1, then constant."""
    if warmup_steps <= 0:
        return lambda step: 1.0
    return lambda step: min(1.0, (step + 1) / warmup_steps)


@dataclass
class Precision:
    """Autocast dtype and (fp16 on CUDA) the GradScaler; fp32 is a no-op."""

    name: str
    device_type: str
    dtype: torch.dtype | None
    scaler: Any | None = None

    @classmethod
    def create(cls, name: str, device: torch.device, sharded: bool = False) -> Precision:
        """The precision `name` on `device`; `sharded` (FSDP) gets the ShardedGradScaler,
        which agrees on inf/NaN gradients over all ranks before skipping a step.

        Raises:
            PrecisionError: fp16 without CUDA, bf16 on a GPU without bf16, unknown name.
        """
        dev = device.type
        if name == "fp32":
            return cls(name, dev, None)
        if name == "bf16":
            if dev == "cuda" and not torch.cuda.is_bf16_supported():
                raise PrecisionError("bf16 is not supported by this GPU; use --precision fp16")
            return cls(name, dev, torch.bfloat16)
        if name == "fp16":
            if dev != "cuda":
                raise PrecisionError("fp16 autocast needs a CUDA GPU; on CPU use --precision bf16")
            if sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                return cls(name, dev, torch.float16, ShardedGradScaler("cuda"))
            return cls(name, dev, torch.float16, torch.amp.GradScaler("cuda"))
        raise PrecisionError(f"unknown precision {name!r}; choose fp32, bf16 or fp16")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """Adam or SGD(momentum 0.9); Adam with its fused kernel by default.

    The fused Adam does the whole update in one pass per parameter instead of a dozen
    elementwise ops: on the synthetic workload its step takes ~0.4 ms instead of ~1.1 ms
    of a ~3 ms training step (docs/performance.md). Results differ from the for-loop
    Adam only by float rounding.
    """
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name != "adam":
        raise ValueError(f"unknown optimizer {name!r}; choose adam or sgd")
    if fused is None:
        fused = fused_supported(params)
    return torch.optim.Adam(params, lr=lr, fused=fused or None)


def fused_supported(params: Iterable[torch.nn.Parameter]) -> bool:
    """Fused Adam runs on CPU (torch >= 2.4) and CUDA, for floating-point parameters."""
    for p in params:
        dev = p.device.type
        if dev not in ("cpu", "cuda") or not torch.is_floating_point(p):
            return False
    return True
