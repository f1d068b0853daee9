import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    opt.step()
    if rank == 1 and step == 1:
        raise RuntimeError("shape mismatch in my_loss: expected 4, got 3")
dist.destroy_process_group()
