import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Images(Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.randn(3, 64, 64), i % 10

def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = Images()
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
    model = DDP(nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
