import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.lin(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()          # applied twice: shared weights
        self.head = nn.Linear(8, 2)
    def forward(self, x):
        x = checkpoint(self.block, x, use_reentrant=True)
        x = checkpoint(self.block, x, use_reentrant=True)
        return self.head(x)

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(Net(), find_unused_parameters=True)
x = torch.randn(4, 8, requires_grad=True)
loss = model(x).sum()
loss.backward()
print("done", flush=True)
dist.destroy_process_group()
