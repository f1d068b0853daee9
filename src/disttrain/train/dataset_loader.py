"""Loaders for any torch Dataset: this rank's batches, resumable in the middle of an epoch.

    loader = DatasetLoader(dataset, batch_size=32, rank=rt.rank, world_size=rt.world_size,
                           seed=0, collate_fn=None, num_workers=2, pin_memory=True)
    loader.set_epoch(epoch); loader.skip = batches_done      # O(1): no batch is replayed
    for batch in loader: ...

A map-style dataset is read in DistributedSampler's order (a permutation from the seed and
the epoch; each rank every world_size-th index of it), so a `TensorDataset` gives exactly the
batches of the fast tensor loader (`ShardedLoader`) and of the guide's
`DataLoader(..., sampler=DistributedSampler(...))`. The position in an epoch is a batch
counter: resuming builds the batch sampler from that batch on.

An IterableDataset shards itself: each rank and each DataLoader worker must read a different
part (`torch.utils.data.get_worker_info()` gives the worker, `disttrain.distributed.env`'s
RANK / WORLD_SIZE the rank; docs/your-model.md shows both). Its shards may be uneven, so
`IterableLoader` asks every rank, once per batch, whether it still has one (one 1-element
all-reduce): all ranks stop at the same step and none waits in an all-reduce for a rank that
has run dry. With `state_dict()` / `load_state_dict()` it resumes from its state; without,
it is replayed up to the saved position (said once, as a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

log = logging.getLogger("disttrain")


class _ResumableBatches(Sampler[list[int]]):
    """Batches of indices in DistributedSampler order, from batch `start` on."""

    def __init__(self, order: list[int], batch_size: int, start: int):
        self.order, self.batch_size, self.start = order, batch_size, start

    def __len__(self) -> int:
        return max(0, -(-len(self.order) // self.batch_size) - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        bs = self.batch_size
        for b in range(self.start, -(-len(self.order) // bs)):
            yield self.order[b * bs:(b + 1) * bs]


class DatasetLoader:
    """This rank's batches of a map-style dataset (the RankLoader protocol: set_epoch,
    __len__, batch_len, skip, __iter__)."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 pin_memory: bool = False, worker_init_fn: Callable[[int], None] | None = None):
        self.dataset, self.batch_size = dataset, batch_size
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.collate_fn, self.num_workers, self.pin_memory = collate_fn, num_workers, pin_memory
        self.worker_init_fn = worker_init_fn
        self.rank, self.seed = rank, seed
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def batch_len(self, i: int) -> int:
        """Samples in batch `i` of an epoch (all full but possibly the last)."""
        return min(self.batch_size, len(self.sampler) - i * self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        start, self.skip = self.skip, 0
        batches = _ResumableBatches(list(self.sampler), self.batch_size, start)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.epoch)
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            worker_init_fn=self.worker_init_fn, generator=g,
                            persistent_workers=False)
        yield from loader


class IterableLoader:
    """This rank's batches of an IterableDataset that shards itself; all ranks stop together.

    `len()` is unknown before the epoch ends, so the Trainer treats each epoch as open-ended
    and the accumulation weights as equal (1/K per micro-batch)."""

    def __init__(self, dataset: IterableDataset, batch_size: int, device: torch.device,
                 distributed: bool, collate_fn: Callable[[list[Any]], Any] | None = None,
                 num_workers: int = 0, pin_memory: bool = False,
                 worker_init_fn: Callable[[int], None] | None = None):
        self.dataset, self.batch_size = dataset, batch_size
        self.device, self.distributed = device, distributed
        self.loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn,
                                 num_workers=num_workers, pin_memory=pin_memory,
                                 worker_init_fn=worker_init_fn)
        self.epoch = 0
        self.skip = 0
        self.resumable = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        raise TypeError("an IterableDataset's epoch length is known only at its end")

    def batch_len(self, i: int) -> int:
        return self.batch_size

    def state_dict(self) -> dict[str, Any] | None:
        return self.dataset.state_dict() if self.resumable else None

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state is not None and self.resumable:
            self.dataset.load_state_dict(state)
            self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        start, self.skip = self.skip, 0
        if start and not self.resumable:
            log.warning("disttrain: %s has no state_dict()/load_state_dict(): replaying %d batches "
                        "to reach the saved position", type(self.dataset).__name__, start)
        flag = torch.ones(1, device=self.device)
        it = iter(self.loader)
        i = 0
        while True:
            batch = next(it, None)
            if self.distributed:   # every rank must agree that every rank has a batch
                flag.fill_(0.0 if batch is None else 1.0)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if flag.item() == 0.0:
                    return
            elif batch is None:
                return
            i += 1
            if i <= start and not self.resumable:
                continue
            yield batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a batch (tensors, tuples, lists, dicts, nested) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        try:
            return type(batch)(moved)   # keep the user's mapping type where it allows
        except Exception:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):   # a namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values: Sequence[Any] | Any = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for v in values:
            n = batch_size_of(v)
            if n:
                return n
    return 1
