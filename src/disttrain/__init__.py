"""disttrain: PyTorch distributed training, correct and fast, locally and on K3s + HAMi.

    from disttrain import JobSpec, Trainer, build_trainer, runtime
    with runtime.setup() as rt:                     # reads torchrun's env
        summary = build_trainer(JobSpec(), rt).fit()

Heavy names (anything that imports torch) load on first use, so the CLI answers
`--help` and bad-flag errors without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "JobSpec": "disttrain.spec",
    "SpecError": "disttrain.spec",
    "Trainer": "disttrain.trainer",
    "build_trainer": "disttrain.builder",
    "wrap": "disttrain.strategies",
    "unwrap": "disttrain.strategies",
    "run_ranks": "disttrain.testing",
}
_SUBMODULES = {"runtime", "strategies", "data", "models", "checkpoint", "launch", "report", "tuning",
               "fsdp", "comm_hooks"}

__all__ = sorted([*_LAZY, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"disttrain.{name}")
    raise AttributeError(f"module 'disttrain' has no attribute {name!r}")
