"""A script whose rank 0 works without an optimizer (data preparation in plain Python, or an
evaluation: forward passes of a model) for SECONDS while the other ranks wait for it at a
barrier, then finishes; `python script.py SECONDS [prep|eval]`."""
import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group(backend="gloo")
    seconds, mode = float(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "prep")
    if dist.get_rank() == 0:
        model, end, n = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), time.time() + seconds, 0
        with torch.no_grad():
            while time.time() < end:
                if mode == "eval":
                    model(torch.randn(2, 8))
                else:
                    n = sum(i * i for i in range(20000)) + n % 7
        print(f"rank 0 {mode} took {seconds} s", flush=True)
    dist.barrier()
    print("done on rank", dist.get_rank(), flush=True)
    dist.destroy_process_group()
