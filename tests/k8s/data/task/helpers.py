"""Data for mytask: a fixed, learnable two-class problem."""

import torch
from torch.utils.data import TensorDataset


def seeded_data(n: int, dim: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())
