"""Reduced from the shape of the DDP tutorial's torchrun script (written for disttrain)."""
import os
import sys

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


class Trainer:
    def __init__(self, model, train_data, optimizer, path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])
        self.train_data = train_data
        self.optimizer = optimizer
        self.path = path
        print("Loading snapshot")

    def _run_epoch(self, epoch):
        print(f"[GPU{self.gpu_id}] Epoch {epoch}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            torch.nn.functional.mse_loss(self.model(source.to(self.gpu_id)), targets).backward()
            self.optimizer.step()

    def _save(self, epoch):
        torch.save({"epoch": epoch}, self.path)
        print(f"Epoch {epoch} | snapshot saved at {self.path}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0:
                self._save(epoch)


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))


def main(dataset, model, epochs):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001 * int(os.environ["WORLD_SIZE"]))
    Trainer(model, prepare_dataloader(dataset, 32), optimizer, "snapshot.pt").train(epochs)
    destroy_process_group()


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        print("Unable to locate 2 GPUs. Exiting.")
        sys.exit()
    main(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)),
         torch.nn.Linear(4, 1), 2)
