"""digits: SimpleNet on scikit-learn's bundled 8x8 handwritten digits, as a TrainTask.
What `disttrain run` trains with no arguments (the reference `disttrain.examples.digits:make_task`).

    disttrain run                                              # the same as:
    disttrain run --task disttrain.examples.digits:make_task
    disttrain run --hidden-size 256                            # = --task-args '{"hidden_size": 256}'
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import Field

from disttrain.examples.classify import classifier_task
from disttrain.examples.datasets import load_dataset, warm_dataset
from disttrain.examples.models import SimpleNet
from disttrain.train.task import TrainTask, task_hooks


def _warm(**_: Any) -> bool:
    return warm_dataset("digits")


@task_hooks(warm=_warm)
def make_task(hidden_size: Annotated[int, Field(ge=1)] = 512) -> TrainTask:
    """SimpleNet 64-`hidden_size`-10 on the 1,797 digits (a fixed 80/20 split).

    Args:
        hidden_size: SimpleNet's hidden width.
    """
    data = load_dataset("digits")
    return classifier_task("digits", data, functools.partial(
        SimpleNet, data.input_size, hidden_size, data.num_classes))
