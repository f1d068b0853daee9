import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def train(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29533"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    x = torch.ones(3)
    if rank == 1:
        x = x[5]   # IndexError
    dist.all_reduce(x)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(train, args=(2,), nprocs=2, join=True)
