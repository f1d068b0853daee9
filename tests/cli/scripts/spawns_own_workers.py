"""Reduced from a `python main.py` DDP example that starts its own ranks with mp.spawn
on a hard-coded port."""
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def demo_basic(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.destroy_process_group()


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)


if __name__ == "__main__":
    run_demo(demo_basic, 2)
