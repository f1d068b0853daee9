"""The built-in workloads as TrainTasks, built the same way as any user's task.

    task = builtin_task(spec, rt)   # spec.workload: digits | mnist | synthetic | seed002 | chargpt

digits, mnist, synthetic and seed002 are classifiers over in-memory tensors: their data is
a `TensorDataset` (which the Trainer reads with its fast tensor loader) and their metric
is `accuracy`; chargpt is a character-level language model (`examples/chargpt.py`).
Nothing in the Trainer is specific to them (docs/your-model.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import TensorDataset

from disttrain.distributed.runtime import Runtime
from disttrain.examples.datasets import TrainTestTensors, is_warm, load_dataset
from disttrain.examples.models import build_model
from disttrain.spec.job import JobSpec
from disttrain.train.task import TrainTask

__all__ = ["accuracy", "builtin_task", "load_splits_local_rank0_first"]


def accuracy(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Correct argmax predictions and the batch's size: summed over every rank's shard,
    their ratio is the held-out accuracy."""
    return (outputs.argmax(dim=1) == batch[1]).sum(), len(batch[1])


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


def builtin_task(spec: JobSpec, rt: Runtime) -> tuple[TrainTask, dict[str, Any]]:
    """The TrainTask of the built-in workload `spec.workload`, and facts for summary.json
    (`data_preloaded`: the data is the warm fork server's shared copy)."""
    if spec.workload == "chargpt":
        from disttrain.examples.chargpt import make_task

        return make_task(), {"data_preloaded": False}
    cfg = spec.train
    load = functools.partial(load_dataset, spec.workload, data_dir=cfg.data_dir,
                             num_samples=cfg.num_samples, input_size=cfg.input_size)
    data = load_splits_local_rank0_first(rt, load, download=cfg.download)
    input_size = cfg.input_size or data.input_size
    task = TrainTask(
        model=functools.partial(build_model, spec.workload, input_size, cfg.hidden_size,
                                data.num_classes),
        train_data=TensorDataset(data.train_x, data.train_y),
        eval_data=TensorDataset(data.test_x, data.test_y),
        loss_fn=torch.nn.CrossEntropyLoss(), metrics={"accuracy": accuracy}, name=spec.workload)
    return task, {"data_preloaded": is_warm(data)}
