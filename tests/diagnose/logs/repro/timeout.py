import datetime
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
rank = dist.get_rank()
x = torch.ones(4)
if rank == 1:
    time.sleep(20)
dist.all_reduce(x)
dist.destroy_process_group()
