"""A DDP tutorial-shaped script (a Trainer class, DDP, one SGD step per batch), unmodified
for disttrain: rank 1 hangs after 3 optimizer steps. `python script.py STEPS [AT]` under
torchrun; AT (default 3) is the step rank 1 hangs at: 0 hangs before the first optimizer step,
while rank 0 waits in its first all-reduce."""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, optimizer):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.optimizer = optimizer

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def train(self, steps, at):
        for step in range(steps):
            if self.rank == 1 and step == at:
                print(f"stalling at {time.time():.3f}", flush=True)
                time.sleep(3600)  # stuck after 3 optimizer steps
            self._run_batch(torch.randn(4, 8), torch.randn(4, 1))


if __name__ == "__main__":
    init_process_group(backend="gloo")
    model = torch.nn.Linear(8, 1)
    at = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01)).train(int(sys.argv[1]), at)
    destroy_process_group()
