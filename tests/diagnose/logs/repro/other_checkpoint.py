import os

import torch
import torch.distributed as dist
from torch import nn


def build(hidden):
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def main():
    dist.init_process_group("gloo")
    path = "other_checkpoint.pt"
    if dist.get_rank() == 0 and not os.path.exists(path):
        torch.save(build(16).state_dict(), path)   # a checkpoint of a smaller model
    dist.barrier()
    model = build(32)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
