"""Written for disttrain: a torchrun script that never picks a GPU per rank, and saves the
DDP wrapper's state_dict through a dict."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(8, 2).cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * dist.get_world_size())
    for _ in range(10):
        loss = model(torch.randn(4, 8).cuda()).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if dist.get_rank() == 0:
        ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(ckpt, "ckpt.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
