"""The built-in workloads' models: SimpleNet (an MLP, 784-512-10 for MNIST) and seed002's
Linear(1000, 10)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class SimpleNet(nn.Module):
    """The 784-512-10 MLP of the usual MNIST DDP script; input and hidden sizes configurable.

    With `gradient_checkpointing_enable()` the hidden block is recomputed in backward
    instead of keeping its activations (`--grad-ckpt`).
    """

    def __init__(self, input_size: int = 784, hidden_size: int = 512, num_classes: int = 10):
        super().__init__()
        self.input_size = input_size
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, num_classes)
        self.grad_ckpt = False

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the hidden block in backward instead of storing its activations."""
        self.grad_ckpt = True

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.input_size)
        if self.grad_ckpt and self.training and torch.is_grad_enabled():
            # use_reentrant=False: the reentrant variant breaks DDP ("mark a variable
            # ready only once") and ignores inputs without requires_grad.
            h = checkpoint(self._block, x, use_reentrant=False)
        else:
            h = self._block(x)
        return self.fc2(h)


class Seed002Net(nn.Sequential):
    """The smoke workload's model: one Linear(1000, 10)."""

    def __init__(self, input_size: int = 1000, num_classes: int = 10):
        super().__init__(nn.Linear(input_size, num_classes))

