import os
import signal
import time

import torch.multiprocessing as mp


def train(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3)

if __name__ == "__main__":
    mp.spawn(train, args=(2,), nprocs=2, join=True)
