"""What the built-in classifier tasks share (digits, mnist, synthetic, seed002): their
metric and the TrainTask over in-memory tensors.

    task = classifier_task("digits", data, functools.partial(SimpleNet, 64, 512, 10))

Their data is a `TensorDataset` of (input, label), which the Trainer reads with its fast
tensor loader (`disttrain.train.loader.ShardedLoader`); their metric is `accuracy`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from disttrain.examples.datasets import TrainTestTensors
from disttrain.train.task import TrainTask

__all__ = ["accuracy", "classifier_task"]


def accuracy(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Correct argmax predictions and the batch's size: summed over every rank's shard,
    their ratio is the held-out accuracy."""
    return (outputs.argmax(dim=1) == batch[1]).sum(), len(batch[1])


def classifier_task(name: str, data: TrainTestTensors, model: Callable[[], nn.Module]) -> TrainTask:
    """A cross-entropy classifier over `data`'s tensors, scored by accuracy."""
    return TrainTask(
        model=model, train_data=TensorDataset(data.train_x, data.train_y),
        eval_data=TensorDataset(data.test_x, data.test_y),
        loss_fn=torch.nn.CrossEntropyLoss(), metrics={"accuracy": accuracy}, name=name)
