#!/usr/bin/env python3
"""A plain, hand-written DDP loop of chargpt (or of any TrainTask's model, data and loss).

    torchrun --standalone --nproc_per_node=2 benchmarks/plain_chargpt.py
    torchrun --standalone --nproc_per_node=2 benchmarks/plain_chargpt.py --epochs 10 --lr 0.002
    torchrun --standalone --nproc_per_node=2 benchmarks/plain_chargpt.py --task mytask:make_task

The reference `disttrain bench overhead --example chargpt` (and `--task REF`) runs beside
the Trainer. It does only what the deployment guide's §6 script does, on a real model:
init_process_group, DataLoader + DistributedSampler + set_epoch, DDP(model), AdamW (or
Adam, to match the Trainer's default optimizer), on gloo, one thread per process. The model,
the data and the loss come from the task (`disttrain.examples.chargpt:make_task` by
default: its TrainTask is read for `model`, `train_data`, `eval_data`, `step_fn` /
`loss_fn` and `collate_fn`); nothing else of disttrain is used.

Measured as docs/performance.md describes and as benchmarks/plain_ddp.py does:
samples_per_s = global samples of the `--steps` steps after `--warmup` steps / their
duration on rank 0. `loss_curve` is [step, loss averaged over ranks] every `--log-every`
steps (kept as tensors and reduced once at the end: no host sync per step), the curve the
Trainer writes to metrics.jsonl. `eval_loss` is the held-out loss after training, every
sample counted once (each rank scores a disjoint slice).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from plain_common import leave, params_sha256, start, write_result
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def load(ref: str, args: dict[str, Any]) -> Any:
    """`module:function` called with `args`, the current folder first on sys.path."""
    module, _, fn = ref.partition(":")
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), fn)(**args)


def to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to(v, device) for v in batch)
    return batch


def loss_of(task: Any, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if task.step_fn is not None:
        out = task.step_fn(model, batch)
        return out[0] if isinstance(out, tuple) else out
    x, y = batch
    return task.loss_fn(model(x), y)


def batch_size_of(batch: Any) -> int:
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch)


@torch.no_grad()
def evaluate(task: Any, model: torch.nn.Module, rank: int, world: int, device: torch.device,
             batch_size: int) -> float | None:
    """Held-out loss weighted by batch size, over every rank's disjoint slice."""
    if task.eval_data is None:
        return None
    model.eval()
    part = torch.utils.data.Subset(task.eval_data, range(rank, len(task.eval_data), world))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in DataLoader(part, batch_size=batch_size, collate_fn=task.collate_fn):
        n = batch_size_of(batch)
        sums += torch.tensor([loss_of(task, model, to(batch, device)).item() * n, n],
                             dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="disttrain.examples.chargpt:make_task", help="module:function")
    p.add_argument("--task-args", default="{}", help="the factory's keyword arguments, as JSON")
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before the window")
    p.add_argument("--epochs", type=int, default=None,
                   help="train whole epochs instead (the window: every step after --warmup)")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3, help="as given (no scaling with world size)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss_curve points")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--no-eval", action="store_true", help="skip the held-out loss at the end")
    p.add_argument("--out", help="write the figures as JSON here (rank 0)")
    args = p.parse_args()
    t_start, rank, world, local_rank, device = start(args.backend, args.threads)
    task = load(args.task, json.loads(args.task_args))
    sampler = DistributedSampler(task.train_data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(task.train_data, batch_size=args.batch_size, sampler=sampler,
                        collate_fn=task.collate_fn)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = task.model() if not isinstance(task.model, torch.nn.Module) else task.model
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank]) if device.type == "cuda" else DDP(model)
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    optimizer = opt_cls(model.parameters(), lr=args.lr)

    total = args.epochs * len(loader) if args.epochs else args.warmup + args.steps
    step, epoch, samples, step_s = 0, 0, 0, []
    curve: list[tuple[int, torch.Tensor]] = []
    first_step_s = None
    t_window = time.perf_counter()
    while step < total:
        sampler.set_epoch(epoch)
        for batch in loader:
            t0 = time.perf_counter()
            batch = to(batch, device)
            optimizer.zero_grad()
            loss = loss_of(task, model, batch)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                first_step_s = time.time() - t_start
            if step == args.warmup:
                t_window = time.perf_counter()
            elif step > args.warmup:
                samples += batch_size_of(batch) * world
                step_s.append(time.perf_counter() - t0)
            if step % args.log_every == 0:
                curve.append((step, loss.detach()))
            if step == total:
                break
        epoch += 1
    window = time.perf_counter() - t_window

    losses = torch.stack([loss for _, loss in curve]) if curve else torch.zeros(0, device=device)
    dist.all_reduce(losses)
    losses /= world
    eval_loss = None if args.no_eval else evaluate(task, model, rank, world, device, args.batch_size)
    hashes = params_sha256(model.module, world)
    if rank == 0:
        tail = losses[-max(1, len(losses) // 10):].tolist() if len(losses) else []
        result = {
            "samples_per_s": samples / window if window > 0 else None,
            "steps": step - args.warmup, "warmup": args.warmup, "epochs": epoch,
            "world_size": world, "batch_size": args.batch_size, "lr": args.lr,
            "optimizer": args.optimizer, "task": args.task, "backend": args.backend,
            "first_step_s": round(first_step_s, 3) if first_step_s is not None else None,
            "step_ms_mean": 1e3 * statistics.fmean(step_s) if step_s else None,
            "step_ms_p50": 1e3 * statistics.median(step_s) if step_s else None,
            "final_loss": statistics.fmean(tail) if tail else None, "eval_loss": eval_loss,
            "loss_curve": [[s, v] for (s, _), v in zip(curve, losses.tolist())],
            "params_in_sync": len(set(hashes)) == 1, "params_sha256": hashes[0],
            "wall_s": round(time.time() - t_start, 3), "torch": torch.__version__,
        }
        write_result(result, args.out)
    leave()   # a barrier, then os._exit: why in plain_common.leave


if __name__ == "__main__":
    main()
