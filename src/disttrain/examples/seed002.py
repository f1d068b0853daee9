"""seed002: the verification write-up's smoke workload, Linear(1000, 10) on random inputs
and labels, as a TrainTask (`disttrain.examples.seed002:make_task`): it tests the plumbing,
the loss need not fall far.

    disttrain run --example seed002 --num-samples 512
"""

from __future__ import annotations

import functools
from typing import Annotated

from pydantic import Field

from disttrain.examples.classify import classifier_task
from disttrain.examples.datasets import load_dataset, warm_dataset
from disttrain.examples.models import Seed002Net
from disttrain.train.task import TrainTask, task_hooks


def _warm(num_samples: int = 2048, input_size: int = 1000, **_: object) -> bool:
    return warm_dataset("seed002", num_samples=num_samples, input_size=input_size)


@task_hooks(warm=_warm)
def make_task(num_samples: Annotated[int, Field(ge=8)] = 2048,
              input_size: Annotated[int, Field(ge=1)] = 1000) -> TrainTask:
    """Linear(`input_size`, 10) on `num_samples` random samples (and an eighth as many held out).

    Args:
        num_samples: training samples.
        input_size: features per sample.
    """
    data = load_dataset("seed002", num_samples=num_samples, input_size=input_size)
    return classifier_task("seed002", data, functools.partial(
        Seed002Net, input_size, data.num_classes))
