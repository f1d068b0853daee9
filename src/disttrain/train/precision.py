"""Mixed precision, the AMP axis of the loop: autocast dtype and loss scaler per device.

    amp = Precision.create("bf16", device)      # amp.autocast(), amp.backward(loss), amp.step(opt)

Uses `torch.autocast(device_type=...)` and `torch.amp.GradScaler`, not the older
CUDA-only `torch.cuda.amp` spellings. fp16 needs CUDA (CPU autocast has no fp16 GEMMs
worth having, and a loss scaler is for fp16's narrow range); bf16 runs on CPU and on
Ampere or newer GPUs without a scaler. Optimizers and LR rules are in `train/optim.py`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.errors import PrecisionError
from disttrain.spec.rules import check_precision

__all__ = ["Precision", "PrecisionError"]


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
            check_precision(name, on_cuda=dev == "cuda")  # the rule `disttrain run` applies
            if sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                # its `device` argument is torch >= 2.3 (torch_compat's fsdp_fp16)
                return cls(name, dev, torch.float16, ShardedGradScaler("cuda"))
            if not hasattr(torch.amp, "GradScaler"):  # torch < 2.3: the same scaler, older name
                return cls(name, dev, torch.float16, torch.cuda.amp.GradScaler())
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
