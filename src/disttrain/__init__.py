"""disttrain: PyTorch distributed training, correct and fast, locally and on K3s + HAMi.

    from disttrain import JobSpec, build_trainer, setup
    with setup() as rt:                             # reads torchrun's env
        summary = build_trainer(JobSpec(), rt).fit()

    from disttrain import TrainTask, fit            # your own model, data and loss
    summary = fit(TrainTask(model=MyNet(), train_data=ds, loss_fn=nn.CrossEntropyLoss()))

Heavy names (anything that imports torch) load on first use, so the CLI answers
`--help` and bad-flag errors without importing torch. The folders under this package
are mapped in docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "JobSpec": "disttrain.spec.job",
    "SpecError": "disttrain.errors",
    "DisttrainError": "disttrain.errors",
    "Trainer": "disttrain.train.trainer",
    "build_trainer": "disttrain.train.build",
    "TrainTask": "disttrain.train.task",
    "TaskError": "disttrain.train.task",
    "fit": "disttrain.train.fit",
    "setup": "disttrain.distributed.runtime",
    "Runtime": "disttrain.distributed.runtime",
    "wrap": "disttrain.distributed.strategies",
    "unwrap": "disttrain.distributed.strategies",
    "no_sync": "disttrain.distributed.strategies",
    "check_in_sync": "disttrain.distributed.sync_check",
    "Precision": "disttrain.train.precision",
    "run_ranks": "disttrain.testing",
}
# short module names a user's own loop reaches for (`from disttrain import runtime`)
_MODULES = {
    "runtime": "disttrain.distributed.runtime",
    "strategies": "disttrain.distributed.strategies",
    "sync_check": "disttrain.distributed.sync_check",
    "comm_hooks": "disttrain.distributed.comm_hooks",
    "testing": "disttrain.testing",
}

__all__ = sorted([*_LAZY, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'disttrain' has no attribute {name!r}")
