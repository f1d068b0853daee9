"""Evaluation that counts each held-out sample once, over every rank's shard.

    evaluator = Evaluator(task, rt, precision, batch_size=1024)
    result = evaluator.run(model)          # {"loss": ..., "accuracy": ...}, the same on all ranks

A map-style eval set is split without DistributedSampler's padding (`eval_shard`: rank r
scores samples r, r + world_size, ...), so no sample is counted twice; an IterableDataset
scores what each rank's stream yields. Every metric is a (sum, count) pair per batch; the
sums of all metrics are all-reduced once per evaluation, then divided. Under FSDP every
forward is a collective, so all ranks run the same number of forwards: a rank whose shard
is shorter repeats a batch with weight zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

from disttrain.distributed.runtime import Runtime
from disttrain.resilience import heartbeat
from disttrain.train.batch import batch_size_of, to_device
from disttrain.train.loader import eval_shard
from disttrain.train.precision import Precision
from disttrain.train.steps import run_step
from disttrain.train.task import TaskError, TrainTask


class Evaluator:
    """Loss and the task's metrics on its eval set (nothing when it has none)."""

    def __init__(self, task: TrainTask, rt: Runtime, precision: Precision, batch_size: int,
                 lockstep: bool, num_workers: int = 0):
        self.task, self.rt, self.precision = task, rt, precision
        self.batch_size, self.lockstep, self.num_workers = batch_size, lockstep, num_workers
        self.names = ["loss", *task.metrics]
        # the held-out set is split over the data slices: the ranks by default; under tp/pp
        # the data-parallel ranks, summed over their group (train/model_parallel.py)
        self.data_rank, self.data_world = rt.rank, rt.world_size
        self.reduce_group: Any = None

    @property
    def enabled(self) -> bool:
        return self.task.eval_data is not None

    @torch.no_grad()
    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """Every metric over the whole eval set; {} without one. A collective: call on all ranks."""
        if not self.enabled:
            return {}
        heartbeat.beat(step, "eval")
        was_training = model.training
        model.eval()
        sums = torch.zeros(2 * len(self.names), dtype=torch.float64, device=self.rt.device)
        for batch, real in self._batches():
            batch = to_device(batch, self.rt.device)
            with self.precision.autocast():
                loss, outputs = run_step(self.task, model, batch)
            if not real:
                continue
            n = batch_size_of(batch)
            sums[0] += loss.detach().double() * n
            sums[1] += n
            for i, (name, fn) in enumerate(self.task.metrics.items(), start=1):
                pair = fn(outputs, batch)
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise TaskError(f"metric {name!r} must return (sum, count), got "
                                    f"{type(pair).__name__}")
                _add(sums, 2 * i, pair[0], name)
                _add(sums, 2 * i + 1, pair[1], name)
        if self.rt.distributed and self.data_world > 1:
            dist.all_reduce(sums, group=self.reduce_group)
        model.train(was_training)
        values = sums.tolist()
        return {name: (values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan"))
                for i, name in enumerate(self.names)}

    # -- this rank's batches, (batch, counts) -------------------------------------------------
    def _batches(self) -> Iterator[tuple[Any, bool]]:
        data = self.task.eval_data
        if isinstance(data, IterableDataset):
            yield from self._stream(data)
            return
        n, rank, world = len(data), self.data_rank, self.data_world
        idx = eval_shard(n, rank, world)
        mine = _ceil_div(len(idx), self.batch_size)
        longest = _ceil_div(_ceil_div(n, world), self.batch_size) if self.lockstep else mine
        batches = self._tensor_batches(data, idx) if _plain_tensors(data, self.task) else \
            iter(DataLoader(Subset(data, idx.tolist()), batch_size=self.batch_size,
                            collate_fn=self.task.collate_fn, num_workers=self.num_workers))
        last = None
        for _ in range(mine):
            last = next(batches)
            yield last, True
        for _ in range(longest - mine):   # FSDP: join the others' forwards, count nothing
            yield (last if last is not None else self._any_batch(data)), False

    def _tensor_batches(self, data: TensorDataset, idx: torch.Tensor) -> Iterator[Any]:
        for i in range(0, len(idx), self.batch_size):
            j = idx[i:i + self.batch_size]
            yield tuple(t.index_select(0, j) for t in data.tensors)

    def _any_batch(self, data: Any) -> Any:
        return next(iter(DataLoader(Subset(data, [0]), batch_size=1, collate_fn=self.task.collate_fn)))

    def _stream(self, data: IterableDataset) -> Iterator[tuple[Any, bool]]:
        """Each rank's own stream; in lockstep, until every rank has run dry."""
        loader = DataLoader(data, batch_size=self.batch_size, collate_fn=self.task.collate_fn,
                            num_workers=self.num_workers)
        it, last = iter(loader), None
        flag = torch.zeros(1, device=self.rt.device)
        while True:
            batch = next(it, None)
            if self.lockstep and self.rt.distributed:
                flag.fill_(0.0 if batch is None else 1.0)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() == 0.0:
                    return
                if batch is None and last is None:
                    raise TaskError("eval_data yielded nothing on this rank while others did: "
                                    "with strategy fsdp every rank needs at least one eval batch")
                yield (batch, True) if batch is not None else (last, False)
            elif batch is None:
                return
            else:
                yield batch, True
            last = batch if batch is not None else last


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _plain_tensors(data: Any, task: TrainTask) -> bool:
    return isinstance(data, TensorDataset) and task.collate_fn is None


def _add(sums: torch.Tensor, k: int, value: Any, name: str) -> None:
    """sums[k] += value, on the device (no host sync per batch)."""
    try:
        if isinstance(value, torch.Tensor):
            sums[k] += value.detach().to(sums.dtype).sum()
        else:
            sums[k] += float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TaskError(f"metric {name!r} must return (sum, count) numbers, got "
                        f"{type(value).__name__}") from None
