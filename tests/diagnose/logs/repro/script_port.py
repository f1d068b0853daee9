"""A script that sets MASTER_PORT itself (over torchrun's) to a port already held."""
import os

import torch.distributed as dist

os.environ["MASTER_PORT"] = "29533"
dist.init_process_group("gloo")
