"""A task declares its batch when the planning machine cannot read its data (issue 22 item 1:
"or declared by the task when reading data is not possible"): `TrainTask.example_batch`."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from disttrain.plan.job import plan_task
from disttrain.plan.trace import Knobs
from disttrain.train.task import TaskError, TrainTask
from tests.plan.tasks import Tower, dict_step, dict_task

KNOBS = Knobs(strategy="ddp", world_size=2, local_world_size=2, batch_size=32)


class OnTheCluster(Dataset):
    """Rows that live on a cluster volume: sized, but unreadable here."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> Any:
        raise FileNotFoundError("/data/rows.parquet")


def declared(batch_size: int) -> dict[str, torch.Tensor]:
    return {"features": torch.zeros(batch_size, 48),
            "label": torch.zeros(batch_size, dtype=torch.long)}


def test_the_declared_batch_is_planned_as_the_read_one() -> None:
    readable = plan_task(dict_task(), KNOBS, search=False)
    unreadable = TrainTask(model=Tower, train_data=OnTheCluster(), step_fn=dict_step,
                           example_batch=declared)
    planned = plan_task(unreadable, KNOBS, search=False)
    assert planned.peak_bytes == readable.peak_bytes
    # the batch size asked for reaches the task's function: twice the batch, more activations
    bigger = plan_task(unreadable, KNOBS.replace(batch_size=64), search=False)
    assert bigger.tensors.largest["activations"] > planned.tensors.largest["activations"]


def test_unreadable_data_without_a_declared_batch_names_example_batch() -> None:
    task = TrainTask(model=Tower, train_data=OnTheCluster(), step_fn=dict_step)
    with pytest.raises(TaskError, match=r"FileNotFoundError.*example_batch=fn\(batch_size\)"):
        plan_task(task, KNOBS, search=False)


def test_a_declared_batch_without_tensors_or_that_raises_is_refused() -> None:
    base = TrainTask(model=Tower, train_data=OnTheCluster(), step_fn=dict_step,
                     example_batch=declared)
    empty = dataclasses.replace(base, example_batch=lambda n: {"features": [0.0] * n})
    with pytest.raises(TaskError, match=r"example_batch\(32\) returned dict with no tensor"):
        plan_task(empty, KNOBS, search=False)

    def broken(n: int) -> Any:
        raise KeyError("vocab")

    with pytest.raises(TaskError, match=r"example_batch\(32\) raised KeyError"):
        plan_task(dataclasses.replace(base, example_batch=broken), KNOBS, search=False)
    with pytest.raises(TaskError, match="example_batch must be callable"):
        dataclasses.replace(base, example_batch=3)
