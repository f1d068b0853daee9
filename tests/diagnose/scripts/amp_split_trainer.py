"""Reduced from the shape of the minGPT DDP trainer (written for disttrain)."""
import os

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, random_split


class Trainer:
    def __init__(self, model, optimizer, dataset):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.loader = DataLoader(dataset, sampler=DistributedSampler(dataset))
        self.model = DDP(model.to(self.local_rank), device_ids=[self.local_rank])
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def _run_batch(self, source, use_amp):
        loss = self.model(source).sum()
        if use_amp:
            self.scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()

    def _run_epoch(self, epoch, dataloader):
        dataloader.sampler.set_epoch(epoch)
        for it, (source, _) in enumerate(dataloader):
            self._run_batch(source.to(self.local_rank), use_amp=True)
            print(f"[RANK{self.global_rank}] Epoch {epoch} | Iter {it}")

    def train(self, epochs):
        for epoch in range(epochs):
            self._run_epoch(epoch, self.loader)
            if self.local_rank == 0:
                torch.save(self.model.module.state_dict(), "snapshot.pt")


def main(dataset, model):
    init_process_group(backend="nccl")
    train_set, _ = random_split(dataset, [48, 16])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4 * int(os.environ["WORLD_SIZE"]))
    Trainer(model, optimizer, train_set).train(2)
    destroy_process_group()
