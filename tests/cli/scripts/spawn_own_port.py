"""Reduced from a `python main.py` DDP tutorial: the script starts its own 2 ranks with
mp.spawn, each sets MASTER_ADDR/MASTER_PORT itself (a free port the parent picked) and
trains a few SGD steps on gloo. `python script.py STEPS [hang-rank]`: with a rank, that
rank hangs after its first step (its peer waits in the next all-reduce)."""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def demo_basic(rank, world_size, port, steps, hang_rank):
    setup(rank, world_size, port)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if rank == hang_rank and step == 1:
            print(f"rank {rank} hangs at {time.time():.3f}", flush=True)
            time.sleep(3600)
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
    print(f"rank {rank} trained {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    hang = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    mp.spawn(demo_basic, args=(2, port, steps, hang), nprocs=2, join=True)
