"""This rank's batches, in DistributedSampler order, resumable mid-epoch by a batch counter.

ShardedLoader gathers batches from in-memory tensors (the built-in workloads: no per-sample
__getitem__ or collate, which cost more than a small model's step); DatasetLoader reads any
map-style Dataset through a DataLoader (a user's task). Both yield the same batches for the
same data, and `skip` resumes either in O(1): no batch is replayed.

    loader = ShardedLoader(data.train_x, data.train_y, batch_size=32, rank=0, world_size=2)
    loader.set_epoch(epoch)            # a new shuffle each epoch, the same on every rank
    loader.skip = 5                    # resume mid-epoch: start at batch 5, no replay
    for x, y in loader: ...

Every rank gets a disjoint shard of each epoch's permutation (seeded by seed and epoch),
in exactly the order `DataLoader(TensorDataset(x, y), sampler=DistributedSampler(...))`
would give, so a resumed run sees the same batches as one that never stopped.
`eval_shard` splits the held-out set without the sampler's padding, so every sample is
scored once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from disttrain.distributed.process import rank_seed

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def batch_seed(seed: int, rank: int, epoch: int, batch: int) -> int:
    """The augmentation seed of one batch: distinct per rank (ranks that drew the same
    noise would augment their shards alike), reproducible, and the same whether the
    batch is made in the training process or in a DataLoader worker, or after a resume
    in the middle of an epoch."""
    return (rank_seed(seed, rank) * 1_000_003 + epoch * 100_003 + batch) % 2**63


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and `random` from the worker's torch seed.

    torch seeds each worker with base_seed + worker_id, and base_seed comes from the
    loader's generator, which ShardedLoader seeds per rank and epoch (`rank_seed`); numpy
    and `random` would otherwise be forked copies, identical in every worker and rank.
    """
    import random

    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


class _Batches(torch.utils.data.Dataset):
    """Whole batches by batch number, so a worker gathers a batch in one index_select."""

    def __init__(self, loader: ShardedLoader, order: torch.Tensor, epoch: int):
        self.loader, self.order, self.epoch = loader, order, epoch

    def __len__(self) -> int:
        return -(-len(self.order) // self.loader.batch_size)

    def __getitem__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.make_batch(self.order, b, self.epoch)


class SampledLoader:
    """A rank's batches in DistributedSampler order: the RankLoader protocol the Trainer
    drives (`set_epoch`, `len`, `batch_len`, `skip` = batches of this epoch already done)."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world_size: int,
                 shuffle: bool, seed: int, drop_last: bool):
        self.batch_size, self.rank, self.seed = batch_size, rank, seed
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.epoch = 0
        self.skip = 0
        # only full batches (an epoch's short last one dropped): pipeline parallel traces
        # its stages for a fixed micro-batch size (train/model_parallel.py)
        self.whole_batches = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        if self.whole_batches:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    def batch_len(self, i: int) -> int:
        """Samples in batch `i` of an epoch (all full but possibly the last)."""
        return min(self.batch_size, len(self.sampler) - i * self.batch_size)


class ShardedLoader(SampledLoader):
    """This rank's batches in DistributedSampler order, one tensor gather per batch.

    Yields exactly what `DataLoader(TensorDataset(x, y), batch_size, sampler=
    DistributedSampler(...))` yields, without per-sample __getitem__ and collate: for
    in-memory tensors that Python loop costs more than a small model's step.

    With `num_workers > 0` batches are made in DataLoader worker processes (for costly
    `transform`s), in the same order and with the same values. `transform(x, generator)`
    is an augmentation; its generator is seeded per (seed, rank, epoch, batch).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_workers: int = 0,
                 transform: Transform | None = None):
        super().__init__(TensorDataset(x, y), batch_size, rank, world_size, shuffle, seed, drop_last)
        self.x, self.y = x, y
        self.num_workers, self.transform = num_workers, transform

    def make_batch(self, order: torch.Tensor, b: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = order[b * self.batch_size:(b + 1) * self.batch_size]
        x = self.x.index_select(0, idx)
        if self.transform is not None:
            g = torch.Generator().manual_seed(batch_seed(self.seed, self.rank, epoch, b))
            x = self.transform(x, g)
        return x, self.y.index_select(0, idx)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        start, self.skip = self.skip, 0
        if self.num_workers == 0:
            for b in range(start, len(self)):
                yield self.make_batch(order, b, self.epoch)
            return
        from torch.utils.data import DataLoader

        g = torch.Generator().manual_seed(rank_seed(self.seed, self.rank) + self.epoch)
        loader = DataLoader(_Batches(self, order, self.epoch), batch_size=None,
                            sampler=range(start, len(self)), num_workers=self.num_workers,
                            worker_init_fn=seed_worker, generator=g)
        yield from loader


class _ResumableBatches(Sampler[list[int]]):
    """Batches of indices in DistributedSampler order, from batch `start` on."""

    def __init__(self, order: list[int], batch_size: int, start: int, stop: int | None = None):
        self.order, self.batch_size, self.start = order, batch_size, start
        self.stop = -(-len(order) // batch_size) if stop is None else stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        bs = self.batch_size
        for b in range(self.start, self.stop):
            yield self.order[b * bs:(b + 1) * bs]


class DatasetLoader(SampledLoader):
    """This rank's batches of any map-style dataset, through a DataLoader (workers, pinned
    memory, the task's collate_fn); a TensorDataset gives ShardedLoader's batches exactly."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 pin_memory: bool = False, worker_init_fn: Callable[[int], None] | None = None):
        super().__init__(dataset, batch_size, rank, world_size, shuffle, seed, drop_last)
        self.dataset, self.collate_fn = dataset, collate_fn
        self.num_workers, self.pin_memory, self.worker_init_fn = num_workers, pin_memory, worker_init_fn

    def __iter__(self) -> Iterator[Any]:
        start, self.skip = self.skip, 0
        batches = _ResumableBatches(list(self.sampler), self.batch_size, start, len(self))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.epoch)
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            worker_init_fn=self.worker_init_fn, generator=g,
                            persistent_workers=False)
        yield from loader


def eval_shard(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices of the held-out set this rank scores: disjoint, no padding, all covered."""
    return torch.arange(rank, n, world_size)
