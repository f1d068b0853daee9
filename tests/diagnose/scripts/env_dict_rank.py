"""Reduced from the shape of the multi-node DDP example (written for disttrain)."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def demo_basic(rank):
    print(f"rank = {dist.get_rank()}")
    model = torch.nn.Linear(10, 5).to(rank)
    ddp_model = DDP(model, device_ids=[rank])
    ddp_model(torch.randn(20, 10)).sum().backward()
    print(f"training completed in rank {rank}!")


def main():
    env_dict = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    rank = int(env_dict["RANK"])
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    torch.accelerator.set_device_index(rank)
    dist.init_process_group(backend="nccl")
    demo_basic(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    if torch.accelerator.device_count() < 2:
        print("Unable to locate sufficient 2 gpus to run this example. Exiting.")
        sys.exit()
    main()
