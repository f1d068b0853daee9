import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
layers = [nn.Linear(16, 32), nn.ReLU()]
if rank == 0:
    layers += [nn.Linear(32, 32), nn.ReLU()]   # only rank 0 adds the extra block
layers.append(nn.Linear(32, 10))
model = DDP(nn.Sequential(*layers))
dist.destroy_process_group()
