"""Every rank leaves on purpose with sys.exit(3)."""
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: config check failed, exiting", flush=True)
sys.exit(3)
