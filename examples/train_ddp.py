#!/usr/bin/env python3
"""The deployment guide's DDP script, written so it is correct on CPU and GPU, alone or in a pod.

    torchrun --nproc_per_node=2 examples/train_ddp.py                 # digits, CPU or GPU
    torchrun --nproc_per_node=2 examples/train_ddp.py --data mnist --data-dir /data/mnist
    disttrain run examples/train_ddp.py --nproc-per-node 2 -- --epochs 3

Needs only torch (plus numpy; scikit-learn for the bundled `digits` data) so it runs
in the guide's pytorch/pytorch image. What differs from the guide's version, and why:
- backend: nccl only when this rank has its own GPU, else gloo (nccl on CPU fails);
- device from LOCAL_RANK, not RANK (RANK is global: wrong on the second node);
- DDP gets device_ids only on GPU (DDP on CPU rejects them);
- MNIST is read from local IDX files; it is never downloaded by every rank at once;
- the learning rate is scaled with the world size (the global batch grows with it);
- set_epoch every epoch; evaluation summed over all ranks; only rank 0 prints and saves;
- a barrier after rank 0 saves, so no rank reads a half-written file; the process
  group is always destroyed, also on error.
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SimpleNet(nn.Module):
    def __init__(self, input_size: int = 784):
        super().__init__()
        self.input_size = input_size
        self.fc1 = nn.Linear(input_size, 512)
        self.fc2 = nn.Linear(512, 10)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.input_size)
        return self.fc2(self.relu(self.fc1(x)))


def setup() -> tuple[int, int, torch.device]:
    """Process group from torchrun's env; one GPU per local rank, else CPU + gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        dist.init_process_group(backend="nccl" if use_gpu else "gloo")
    else:  # plain `python train_ddp.py`: one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def _read_idx(path: Path) -> np.ndarray:
    data = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_data(name: str, data_dir: str) -> tuple[TensorDataset, TensorDataset]:
    if name == "mnist":
        root = Path(data_dir)
        def find(stem: str) -> Path:
            for folder in (root, root / "raw", root / "MNIST" / "raw"):
                for p in (folder / stem, folder / f"{stem}.gz"):
                    if p.exists():
                        return p
            raise SystemExit(f"MNIST file {stem}[.gz] not found under {root}")
        arrays = [_read_idx(find(s)) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
        scale = 255.0
    else:
        import importlib.util

        base = Path(next(iter(importlib.util.find_spec("sklearn").submodule_search_locations)))
        table = np.loadtxt(base / "datasets/data/digits.csv.gz", delimiter=",")
        order = np.random.default_rng(1234).permutation(len(table))
        table, n_test = table[order], len(table) // 5
        arrays = [table[n_test:, :-1], table[n_test:, -1], table[:n_test, :-1], table[:n_test, -1]]
        scale = 16.0
    def to_x(a: np.ndarray) -> torch.Tensor:
        return (torch.tensor(a, dtype=torch.float32).flatten(1) / scale - 0.5) / 0.5
    return (TensorDataset(to_x(arrays[0]), torch.tensor(arrays[1], dtype=torch.long)),
            TensorDataset(to_x(arrays[2]), torch.tensor(arrays[3], dtype=torch.long)))


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, rank: int, world: int,
             device: torch.device) -> tuple[float, float]:
    """Loss/accuracy over the whole test set: each rank scores a slice, then all-reduce."""
    model.eval()
    x, y = data.tensors[0][rank::world].to(device), data.tensors[1][rank::world].to(device)
    out = model(x)
    totals = torch.tensor([nn.functional.cross_entropy(out, y, reduction="sum").item(),
                           (out.argmax(1) == y).sum().item(), len(y)], device=device)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--data-dir", default="/data/mnist")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.001, help="base LR, scaled by world size")
    parser.add_argument("--save", default="model.pth")
    args = parser.parse_args()

    rank, world, device = setup()
    try:
        train_set, test_set = load_data(args.data, args.data_dir)
        torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
        model = SimpleNet(train_set.tensors[0].shape[1]).to(device)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
        criterion = nn.CrossEntropyLoss()

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a different shuffle every epoch
            for data, target in loader:
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                loss = criterion(model(data), target)
                loss.backward()
                optimizer.step()
            test_loss, test_acc = evaluate(model, test_set, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: train loss {loss.item():.4f} "
                      f"test loss {test_loss:.4f} test acc {test_acc:.4f}", flush=True)

        if rank == 0:
            torch.save(model.module.state_dict(), args.save)
            print(f"model saved to {args.save}", flush=True)
        dist.barrier()  # others may read the file only after rank 0 wrote it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
