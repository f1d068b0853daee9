import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)
print(f"rank {rank} step 0 loss 2.3026", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(x)
dist.barrier()
dist.destroy_process_group()
