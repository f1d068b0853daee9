"""A script that never steps an optimizer (evaluation, data prep): it runs for SECONDS
and finishes; `python script.py SECONDS`."""
import sys
import time

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group(backend="gloo")
    time.sleep(float(sys.argv[1]))
    dist.barrier()
    print("done on rank", dist.get_rank(), flush=True)
    dist.destroy_process_group()
