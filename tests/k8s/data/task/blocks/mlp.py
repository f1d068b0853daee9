from torch import nn


class MLP(nn.Sequential):
    def __init__(self, inputs: int, hidden: int, outputs: int) -> None:
        super().__init__(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))
