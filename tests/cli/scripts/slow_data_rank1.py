"""A DDP training loop whose rank 1 waits SLOW seconds for each batch (a slow data loader):
the straggler by data. `python script.py STEPS SLOW` under torchrun."""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def batches(rank, steps, slow):
    for _ in range(steps):
        if rank == 1:
            time.sleep(slow)
        yield torch.randn(4, 8), torch.randn(4, 1)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, steps, slow = int(os.environ["RANK"]), int(sys.argv[1]), float(sys.argv[2])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(rank, steps, slow):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    dist.destroy_process_group()
