import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.aux_head = nn.Linear(8, 2)   # never used in forward
        self.fc2 = nn.Linear(8, 2)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
