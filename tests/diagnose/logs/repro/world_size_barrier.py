"""Two processes told the world has three: the group never forms (file:// store)."""
import datetime
import os

import torch.distributed as dist

dist.init_process_group("gloo", init_method="file:///tmp/dtfx/ws_store",
                        rank=int(os.environ["RANK"]), world_size=3,
                        timeout=datetime.timedelta(seconds=8))
