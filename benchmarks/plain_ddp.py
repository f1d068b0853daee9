#!/usr/bin/env python3
"""The plain, hand-written DDP loop a user starts from, on the synthetic benchmark workload.

    torchrun --standalone --nproc_per_node=2 benchmarks/plain_ddp.py
    torchrun --standalone --nproc_per_node=2 benchmarks/plain_ddp.py --steps 300 --warmup 20 --out plain.json

The reference the project's benchmarks compare with (`disttrain bench overhead` runs it
beside the Trainer). It imports no disttrain and does only what a textbook DDP script does:
init_process_group, DistributedSampler + set_epoch, DDP(model), Adam, CrossEntropyLoss,
on gloo, one thread per process. The workload is docs/performance.md's and the same data
as `disttrain run --example synthetic`: SimpleNet 784-512-10, batch 64 per process,
60,000 N(0, 1) images (seed 1234) labelled by a fixed random linear teacher (seed 4321).

Measured as docs/performance.md describes: samples_per_s = global samples of the `--steps`
steps after `--warmup` steps / their duration on rank 0; first_step_s = start of the
launcher's process (torchrun, this worker's parent, read from /proc) -> end of the first
optimizer step, the measure disttrain's summary.json calls first_step_s. `loss_curve` is
[step, loss averaged over ranks] every `--log-every` steps (reduced once at the end), the
curve the Trainer writes to metrics.jsonl.

`--loader dataloader` (default) is the usual DataLoader over a TensorDataset;
`--loader index` takes each batch by indexing in DistributedSampler's order (what
disttrain's ShardedLoader does), to separate data-loading cost from the rest.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
from plain_common import leave, params_sha256, start, write_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SimpleNet(nn.Module):
    """The guide's model."""

    def __init__(self, input_size: int = 784, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.relu = nn.ReLU()
        self.input_size = input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x.view(-1, self.input_size))))


def synthetic(num_samples: int, input_size: int) -> TensorDataset:
    """disttrain.examples.datasets.load_synthetic's training split, rebuilt with torch alone."""
    x = torch.randn(num_samples + max(num_samples // 10, 1), input_size,
                    generator=torch.Generator().manual_seed(1234))
    teacher = torch.randn(input_size, 10, generator=torch.Generator().manual_seed(4321))
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x[:num_samples], y[:num_samples])


def batches(ds: TensorDataset, sampler: DistributedSampler, batch_size: int, how: str):
    if how == "dataloader":
        return iter(DataLoader(ds, batch_size=batch_size, sampler=sampler))
    order = torch.tensor(list(sampler))
    x, y = ds.tensors
    return ((x[order[i:i + batch_size]], y[order[i:i + batch_size]])
            for i in range(0, len(order), batch_size))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before the window")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-samples", type=int, default=60_000)
    p.add_argument("--input-size", type=int, default=784)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--loader", default="dataloader", choices=["dataloader", "index"])
    p.add_argument("--log-every", type=int, default=10, help="steps between loss_curve points")
    p.add_argument("--out", help="write the figures as JSON here (rank 0)")
    args = p.parse_args()
    t_start, rank, world, local_rank, device = start(args.backend, args.threads)
    ds = synthetic(args.num_samples, args.input_size)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = SimpleNet(args.input_size).to(device)
    model = DDP(model, device_ids=[local_rank]) if device.type == "cuda" else DDP(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    total = args.warmup + args.steps
    step, epoch, samples, losses, step_s = 0, 0, 0, [], []
    curve: list[tuple[int, torch.Tensor]] = []
    first_step_s = None
    t_window = time.perf_counter()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    while step < total:
        sampler.set_epoch(epoch)
        for data, target in batches(ds, sampler, args.batch_size, args.loader):
            t0 = time.perf_counter()
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                first_step_s = time.time() - t_start
            if step == args.warmup:
                t_window = time.perf_counter()
                faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            elif step > args.warmup:
                samples += len(data) * world
                step_s.append(time.perf_counter() - t0)
            if step > total - 10:
                losses.append(loss.item())
            if step % args.log_every == 0:
                curve.append((step, loss.detach()))
            if step == total:
                break
        epoch += 1
    window = time.perf_counter() - t_window
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0

    hashes = params_sha256(model.module, world)
    final = torch.tensor([sum(losses) / max(len(losses), 1)], device=device)
    dist.all_reduce(final)
    points = torch.stack([v for _, v in curve]) if curve else torch.zeros(0, device=device)
    dist.all_reduce(points)
    points /= world
    if rank == 0:
        result = {
            "samples_per_s": samples / window, "steps": args.steps, "warmup": args.warmup,
            "world_size": world, "batch_size": args.batch_size, "loader": args.loader,
            "backend": args.backend, "first_step_s": round(first_step_s, 3),
            "step_ms_mean": 1e3 * statistics.fmean(step_s) if step_s else None,
            "step_ms_p50": 1e3 * statistics.median(step_s) if step_s else None,
            "minflt_per_step": faults / max(args.steps, 1),
            "final_loss": final.item() / world, "params_in_sync": len(set(hashes)) == 1,
            "params_sha256": hashes[0], "torch": torch.__version__,
            "loss_curve": [[s, v] for (s, _), v in zip(curve, points.tolist())],
        }
        write_result(result, args.out)
    leave()   # a barrier, then os._exit: why in plain_common.leave


if __name__ == "__main__":
    main()
