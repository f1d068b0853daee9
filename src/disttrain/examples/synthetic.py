"""synthetic: SimpleNet on Gaussian inputs labelled by a fixed random linear teacher, as a
TrainTask (`disttrain.examples.synthetic:make_task`): learnable, offline, any size; the
benchmark workload (docs/performance.md).

    disttrain run --example synthetic --num-samples 8192 --input-size 128
    disttrain run --task disttrain.examples.synthetic:make_task --task-args '{"num_samples": 8192}'
"""

from __future__ import annotations

import functools
from typing import Annotated

from pydantic import Field

from disttrain.examples.classify import classifier_task
from disttrain.examples.datasets import load_dataset, warm_dataset
from disttrain.examples.models import SimpleNet
from disttrain.train.task import TrainTask, task_hooks

Samples = Annotated[int, Field(ge=8)]
Size = Annotated[int, Field(ge=1)]


def _warm(num_samples: int = 60_000, input_size: int = 784, **_: object) -> bool:
    return warm_dataset("synthetic", num_samples=num_samples, input_size=input_size)


@task_hooks(warm=_warm)
def make_task(num_samples: Samples = 60_000, input_size: Size = 784,
              hidden_size: Size = 512) -> TrainTask:
    """SimpleNet `input_size`-`hidden_size`-10 on `num_samples` training samples (and a
    tenth as many held out).

    Args:
        num_samples: training samples.
        input_size: features per sample (and SimpleNet's input width).
        hidden_size: SimpleNet's hidden width.
    """
    data = load_dataset("synthetic", num_samples=num_samples, input_size=input_size)
    return classifier_task("synthetic", data, functools.partial(
        SimpleNet, input_size, hidden_size, data.num_classes))
