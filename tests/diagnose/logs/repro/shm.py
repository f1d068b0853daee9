import torch
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.randn(3, 224, 224), i % 10

if __name__ == "__main__":
    loader = DataLoader(Images(), batch_size=16, num_workers=2)
    for epoch in range(2):
        for step, (x, _y) in enumerate(loader):
            print(f"epoch {epoch} step {step} batch {tuple(x.shape)}", flush=True)
