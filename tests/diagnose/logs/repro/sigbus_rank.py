"""Rank 1 dies of SIGBUS (as a rank whose shared-memory page cannot be backed does)."""
import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)
print(f"rank {rank} step 0 ok", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGBUS)
dist.all_reduce(x)
