"""mnist: SimpleNet 784-512-10 on MNIST from local IDX files, as a TrainTask
(`disttrain.examples.mnist:make_task`). Nothing is downloaded unless asked.

    disttrain run --example mnist --data-dir /data/mnist
    disttrain run --task disttrain.examples.mnist:make_task --task-args '{"download": true}'

Before any process starts, `disttrain run` checks that the files are there (unless
`download` is on), so a wrong folder is one line and nothing is written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field

from disttrain import envvars
from disttrain.examples.classify import classifier_task
from disttrain.examples.datasets import (
    DEFAULT_MNIST_DIR,
    TrainTestTensors,
    find_mnist,
    load_dataset,
    mnist_candidates,
    warm_dataset,
)
from disttrain.examples.models import SimpleNet
from disttrain.train.task import TaskError, TrainTask, task_hooks

__all__ = ["load_splits_local_rank0_first", "make_task"]


class Ranks(Protocol):
    """What the rank-0-first load needs to know of this process's place in the job."""

    world_size: int
    local_rank: int

    def barrier(self) -> None: ...


def load_splits_local_rank0_first(rt: Ranks, load: Callable[..., TrainTestTensors],
                                  download: bool) -> TrainTestTensors:
    """Load the data on every rank; a download happens on each node's local rank 0 alone,
    before the other ranks load.

    Had every rank loaded at once, the others (which must not all download into the same
    folder) would look for the files while local rank 0 is still fetching them, and fail.
    So local rank 0 loads first (downloading if needed: once per node, since nodes need
    not share a filesystem; on a shared one the downloads are atomic renames of the same
    bytes), all ranks meet at a barrier, and then the others load what is now on disk.

    Args:
        rt: this process's place in the job (its barrier is a no-op at world size 1).
        load: the loader, called as `load(download=...)`.
        download: whether a missing dataset may be downloaded.

    Returns:
        This rank's data.
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


class _LiveGroup:
    """This process's place in the live process group (the Trainer builds the task after
    creating it), or a single process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        live = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if live else 1
        self.local_rank = envvars.int_var(envvars.LOCAL_RANK, 0) if live else 0

    def barrier(self) -> None:
        self._dist.barrier()


def _check(data_dir: str = DEFAULT_MNIST_DIR, download: bool = False, **_: Any) -> None:
    if not download and find_mnist(Path(data_dir)) is None:
        looked = ", ".join(str(p) for p in mnist_candidates(Path(data_dir)))
        raise TaskError(f"task_args.data_dir: MNIST IDX files not found in {looked}; put them "
                        f"there, pass --data-dir DIR, or add --download")


def _warm(data_dir: str = DEFAULT_MNIST_DIR, **_: Any) -> bool:
    return warm_dataset("mnist", data_dir=data_dir)   # never downloads


@task_hooks(check=_check, warm=_warm)
def make_task(data_dir: str = DEFAULT_MNIST_DIR, download: bool = False,
              hidden_size: Annotated[int, Field(ge=1)] = 512) -> TrainTask:
    """SimpleNet 784-`hidden_size`-10 on MNIST's 60,000 + 10,000 images.

    Args:
        data_dir: the folder with the four IDX files (raw or .gz, flat or in torchvision's
            MNIST/raw layout); default /data/mnist, where the cluster's pods mount it.
        download: fetch missing files (each node's local rank 0, before the others load).
        hidden_size: SimpleNet's hidden width.
    """
    load = functools.partial(load_dataset, "mnist", data_dir=os.fspath(data_dir))
    data = load_splits_local_rank0_first(_LiveGroup(), load, download=download)
    return classifier_task("mnist", data, functools.partial(
        SimpleNet, data.input_size, hidden_size, data.num_classes))
