"""A user's task as it ships to a cluster: its module imports a local module (helpers.py)
and a local package (blocks/), which `disttrain k8s render` ships with it."""

from pathlib import Path

from blocks.mlp import MLP
from helpers import seeded_data
from torch import nn

from disttrain import TrainTask


def make_task(hidden: int = 16) -> TrainTask:
    # which copy of this file the pod imported: run-local's test checks it is the shipped one
    print(f"task module: {Path(__file__).resolve()}", flush=True)
    return TrainTask(model=lambda: MLP(8, hidden, 2), train_data=seeded_data(256, 8),
                     eval_data=seeded_data(64, 8, seed=1), loss_fn=nn.CrossEntropyLoss(),
                     fsdp_block=MLP)
