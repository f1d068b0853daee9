import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
hidden = 64 if rank == 0 else 128   # e.g. a config read differently per rank
model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 10))
model = DDP(model)
print("built", flush=True)
dist.destroy_process_group()
