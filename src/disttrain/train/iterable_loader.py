"""This rank's batches of an IterableDataset that shards itself; every rank stops together.

An IterableDataset must read a different part on each rank and each DataLoader worker
(`torch.utils.data.get_worker_info()` gives the worker; RANK / WORLD_SIZE, or
`torch.distributed.get_rank()`, the rank: docs/your-model.md shows both). Its shards may be
uneven, so `IterableLoader` asks every rank, once per batch, whether it still has one (one
1-element all-reduce): all ranks stop at the same step and none waits in a gradient all-reduce
for a rank that has run dry. With `state_dict()` / `load_state_dict()` it resumes from its
state; without, it is replayed up to the saved position (said once, as a warning).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset


class IterableLoader:
    """This rank's batches of an IterableDataset that shards itself; all ranks stop together.

    `len()` is unknown before the epoch ends, so the Trainer treats each epoch as open-ended
    and the accumulation weights as equal (1/K per micro-batch).

    Resuming from the stream's own state needs that state in this process, so it is used
    with `num_workers=0` (with workers each holds a copy: the stream is replayed instead).
    The state is read right before each batch is pulled: what a checkpoint saves is the
    position after the last batch the Trainer was handed, also when one batch was read
    ahead. A restored state is applied when the epoch's iteration starts, after
    `set_epoch` (which a stream may use to rewind itself)."""

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
        self.resumable = num_workers == 0 and all(
            callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict"))
        self._before: Any = None            # the stream's state before the latest pull
        self._pending: Mapping[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        raise TypeError("an IterableDataset's epoch length is known only at its end")

    def batch_len(self, i: int) -> int:
        return self.batch_size

    def state_dict(self) -> Any:
        """The stream's position after the batches handed out (None when not resumable)."""
        if not self.resumable:
            return None
        return self._before if self._before is not None else self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state is not None and self.resumable:
            self._pending = state

    def __iter__(self) -> Iterator[Any]:
        start, self.skip = self.skip, 0
        if self._pending is not None:
            if start:   # a checkpoint between epochs needs no position: the epoch starts afresh
                self.dataset.load_state_dict(self._pending)
            self._pending, start = None, 0
        elif start:
            # stderr, not logging: the user must see it whatever logging is set up to do
            print(f"disttrain: warning: {type(self.dataset).__name__} has no state_dict()/"
                  f"load_state_dict() usable here: replaying {start} batches to reach the saved "
                  f"position", file=sys.stderr, flush=True)
        flag = torch.ones(1, device=self.device)
        it = iter(self.loader)
        i = 0
        while True:
            if self.resumable:
                self._before = copy.deepcopy(self.dataset.state_dict())
            batch = next(it, None)
            if self.distributed:   # every rank must agree that every rank has a batch
                flag.fill_(0.0 if batch is None else 1.0)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if flag.item() == 0.0:
                    return
            elif batch is None:
                return
            i += 1
            if i <= start:
                continue
            yield batch
