"""A built-in workload, ready to train: its model and this rank's loaders.

    workload = build_workload(spec, rt)      # spec.workload: digits | mnist | synthetic | seed002
    workload.model, workload.loader, workload.test_x, workload.test_y

The spec's `example` field names the workload. `train.build.build_trainer` calls this for
the model and the data and does everything else (strategy, optimizer, schedule, writer)
itself, the same for any model it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.distributed.process import seed_everything
from disttrain.distributed.runtime import Runtime
from disttrain.examples.datasets import TrainTestTensors, is_warm, load_dataset
from disttrain.examples.models import build_model
from disttrain.spec.job import JobSpec
from disttrain.train.loader import ShardedLoader

__all__ = ["Workload", "build_workload", "load_splits_local_rank0_first"]


@dataclass
class Workload:
    """A built-in workload on this rank: the bare model and the data, before any wrapper."""

    name: str
    model: nn.Module            # seeded the same on every rank, not yet wrapped or sharded
    loader: ShardedLoader       # this rank's training batches
    test_x: torch.Tensor        # the whole held-out split (each rank scores its share)
    test_y: torch.Tensor
    train_samples: int
    data_preloaded: bool        # the warm fork server's shared copy of the data

    @property
    def test_samples(self) -> int:
        return len(self.test_x)


def load_splits_local_rank0_first(rt: Runtime, load: Callable[..., TrainTestTensors],
                                  download: bool) -> TrainTestTensors:
    """Load the data on every rank; a download happens on each node's local rank 0 alone,
    before the other ranks load.

    Had every rank loaded at once, the others (which must not all download into the same
    folder) would look for the files while local rank 0 is still fetching them, and fail.
    So local rank 0 loads first (downloading if needed: once per node, since nodes need
    not share a filesystem; on a shared one the downloads are atomic renames of the same
    bytes), all ranks meet at a barrier, and then the others load what is now on disk.

    Args:
        rt: this process's runtime (its barrier is a no-op at world size 1).
        load: the loader, called as `load(download=...)`.
        download: whether a missing dataset may be downloaded.

    Returns:
        This rank's data.

    Example:
        >>> data = load_splits_local_rank0_first(rt, partial(load_dataset, "mnist"), True)
    """
    if not download or rt.world_size == 1:
        return load(download=download)
    if rt.local_rank == 0:
        try:
            return load(download=True)
        finally:
            # NOTE: meet the barrier even when the download failed, so the other ranks
            # fail at once on the missing files instead of waiting out the timeout.
            rt.barrier()
    rt.barrier()
    return load(download=False)


def build_workload(spec: JobSpec, rt: Runtime) -> Workload:
    """The model and loaders of the built-in workload `spec.workload`, on this rank.

    The seed is set right before the model is made, so every rank starts from the same
    weights (DDP would broadcast them anyway; FSDP and the sync check need it).
    """
    cfg = spec.train
    load = functools.partial(load_dataset, spec.workload, data_dir=cfg.data_dir,
                             num_samples=cfg.num_samples, input_size=cfg.input_size)
    data = load_splits_local_rank0_first(rt, load, download=cfg.download)
    seed_everything(cfg.seed)
    model = build_model(spec.workload, cfg.input_size or data.input_size, cfg.hidden_size,
                        data.num_classes)
    loader = ShardedLoader(data.train_x, data.train_y, cfg.batch_size, rt.rank,
                           rt.world_size, shuffle=True, seed=cfg.seed, num_workers=cfg.num_workers)
    return Workload(spec.workload, model, loader, data.test_x, data.test_y,
                    train_samples=len(data.train_x), data_preloaded=is_warm(data))
