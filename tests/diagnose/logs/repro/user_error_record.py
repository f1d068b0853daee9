import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def load_batch(rank):
    if rank == 1:
        raise ValueError("could not convert string to float: 'label'")
    return torch.ones(4)

@record
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(3):
        x = load_batch(rank)
        dist.all_reduce(x)
        print(f"step {step} ok", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
