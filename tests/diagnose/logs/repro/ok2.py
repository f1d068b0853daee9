import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05 * world)
for epoch in range(3):
    for step in range(4):
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
if rank == 0:
    print("training done", flush=True)
dist.destroy_process_group()
