"""How one batch becomes a loss: the task's step_fn, or loss_fn(model(input), target).

The checks here are the ones a user meets on their first batch (a batch the default loss
cannot unpack, a loss that is not a scalar): each is a TaskError that says what was
received and what to pass instead, raised on the first step rather than deep in backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from disttrain.train.task import TaskError, TrainTask


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {sorted(map(str, batch))[:6]}"
    if isinstance(batch, (list, tuple)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return f"a {type(batch).__name__}"


def run_step(task: TrainTask, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
    """The loss of `batch` (a scalar tensor) and the model's outputs (None when the task's
    step_fn returns only the loss).

    Raises:
        TaskError: the batch is not `(input, target)` and the task has no step_fn, or the
            loss is not a scalar tensor.
    """
    if task.step_fn is not None:
        out = task.step_fn(model, batch)
        loss, outputs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        where = "step_fn"
    else:
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise TaskError(f"the batches are {_describe(batch)}, not (input, target) pairs the "
                            f"default loss can unpack: give the TrainTask a step_fn(model, batch) "
                            f"-> loss")
        assert task.loss_fn is not None   # a TrainTask has loss_fn or step_fn
        inputs, target = batch
        outputs = model(inputs)
        loss = task.loss_fn(outputs, target)
        where = "loss_fn"
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TaskError(f"{where} must return a scalar loss tensor, got {got}: reduce it "
                        f"(e.g. .mean()) or use a loss with reduction='mean'")
    if not loss.requires_grad and torch.is_grad_enabled():
        raise TaskError(f"{where} returned a loss that does not depend on the model's "
                        f"parameters (requires_grad is False): compute it from the model's outputs")
    return loss, outputs
