"""The deployment guide's MNIST DDP script as a TrainTask: only what is yours stays.

    disttrain run --task examples/mnist_task.py:make_task --epochs 5
    disttrain run --task mnist_task:make_task --task-args '{"root": "/data/mnist"}' -f job.yaml

The guide's script (§6.1) spends most of its lines on what every DDP job repeats: the
process group, LOCAL_RANK and the device, DistributedSampler and set_epoch, DDP, rank-0
printing and saving, teardown. Here they are the Trainer's; this file says only what the
model is, what the data is, and how a batch is scored. docs/your-model.md goes through the
conversion step by step.

The data is read from the IDX files in `root` (the guide's /data/mnist; raw or .gz, flat
or in torchvision's MNIST/raw layout) with numpy alone, so the pod's image needs nothing
beyond torch; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from disttrain import TrainTask

FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(root: Path, name: str) -> np.ndarray:
    """One IDX file (raw or .gz) from `root` or `root/MNIST/raw`."""
    for folder in (root, root / "MNIST" / "raw"):
        for path in (folder / name, folder / f"{name}.gz"):
            if path.is_file():
                data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
                ndim = data[3]
                shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
                return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    raise FileNotFoundError(f"{name}(.gz) not found in {root} or {root / 'MNIST' / 'raw'}")


class MNIST(Dataset):
    """MNIST from local IDX files, normalised as the guide's transform does
    (ToTensor, then Normalize((0.5,), (0.5,)))."""

    def __init__(self, root: str | Path, train: bool):
        images, labels = (read_idx(Path(root), f) for f in FILES[train])
        self.x = (torch.from_numpy(images.copy()).float() / 255.0 - 0.5) / 0.5
        self.y = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i].unsqueeze(0), self.y[i]


class SimpleNet(nn.Module):
    """The guide's model."""

    def __init__(self, hidden: int = 512):
        super().__init__()
        self.fc1, self.fc2, self.relu = nn.Linear(784, hidden), nn.Linear(hidden, 10), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x.view(-1, 784))))


def accuracy(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(correct, seen) of one batch; the Trainer sums both over all ranks."""
    return (outputs.argmax(1) == batch[1]).sum(), len(batch[1])


def make_task(root: str = "/data/mnist", hidden: int = 512) -> TrainTask:
    """The guide's job: SimpleNet on MNIST, cross-entropy, accuracy on the test split."""
    return TrainTask(model=lambda: SimpleNet(hidden), train_data=MNIST(root, train=True),
                     eval_data=MNIST(root, train=False), loss_fn=nn.CrossEntropyLoss(),
                     metrics={"accuracy": accuracy}, name="mnist")
