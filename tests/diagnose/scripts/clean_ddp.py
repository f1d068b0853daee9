"""A DDP training script that follows the whole checklist; `disttrain lint` finds nothing.

    torchrun --nproc-per-node 2 clean_ddp.py      # gloo on CPU, nccl when GPUs are there

DDP with one process per device, the backend chosen from the device, the device from
LOCAL_RANK, a DistributedSampler with set_epoch, lr scaled with the world size, output
and checkpoints on rank 0 only, a barrier before everyone reads the checkpoint back, and
the process group destroyed even after an error.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BASE_LR = 0.05
EPOCHS = 2


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        train(use_cuda)
    finally:
        dist.destroy_process_group()


def train(use_cuda: bool) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same data and initial weights on every rank
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DDP(net.to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * world_size)
    loss_fn = torch.nn.CrossEntropyLoss()
    checkpoint = os.environ.get("CHECKPOINT", "clean_ddp.pt")

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
            torch.save(model.module.state_dict(), checkpoint)
        dist.barrier()  # nobody reads the checkpoint before rank 0 has written it

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state)
    if rank == 0:
        print("training done", flush=True)


if __name__ == "__main__":
    main()
