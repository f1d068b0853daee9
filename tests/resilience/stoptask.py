"""A tiny TrainTask for the graceful-stop tests (tests/resilience/test_preemption.py).

`make_task(mark=PATH, mark_at=N, step_sleep_s=S)`: rank 0 creates PATH once it has run N
micro-batches, and every rank sleeps S seconds per micro-batch, so the test's SIGTERM
lands mid-run whatever the machine's speed; the sleep changes no number, so a reference
run without it ends with the same parameters. `slow_save_at=N` makes rank 0's
checkpoint writes from optimizer step N on write the file and then sit there (creating
PATH + ".save" first): a signal then arrives inside a checkpoint write.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from disttrain import TrainTask


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def make_task(mark: str = "", mark_at: int = 0, step_sleep_s: float = 0.0,
              slow_save_at: int = 0) -> TrainTask:
    rank0 = os.environ.get("RANK", "0") == "0"
    calls = {"n": 0}

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if rank0 and mark_at and calls["n"] == mark_at:
            Path(mark).touch()
        time.sleep(step_sleep_s)
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    if slow_save_at and rank0:
        _slow_saves_from(slow_save_at, Path(mark + ".save"))
    return TrainTask(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                     train_data=_data(1024, 0), eval_data=_data(64, 1), step_fn=step_fn)


def _slow_saves_from(step: int, marker: Path) -> None:
    """torch.save of a checkpoint at `step` or later writes it, then sleeps before the
    atomic rename can happen (this worker process only)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        if isinstance(obj, dict) and obj.get("step", -1) >= step:
            marker.touch()
            time.sleep(600)

    torch.save = save
