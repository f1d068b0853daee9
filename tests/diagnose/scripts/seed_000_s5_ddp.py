import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

def setup(rank, world_size):
    """初始化分布式环境"""
    dist.init_process_group(
        backend="nccl",  # GPU 用 nccl, CPU 用 gloo
        rank=rank,
        world_size=world_size
    )
    torch.cuda.set_device(rank)

def cleanup():
    dist.destroy_process_group()

def train(rank, world_size):
    setup(rank, world_size)
    
    # 创建模型
    model = MyModel().to(rank)
    model = DDP(model, device_ids=[rank])
    
    # 创建分布式数据加载器
    train_dataset = MyDataset()
    train_sampler = DistributedSampler(
        train_dataset,
        num_replicas=world_size,
        rank=rank
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=32,
        sampler=train_sampler
    )
    
    # 训练循环
    for epoch in range(num_epochs):
        train_sampler.set_epoch(epoch)  # 必须调用！
        for batch in train_loader:
            output = model(batch["input"].to(rank))
            loss = criterion(output, batch["target"].to(rank))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    
    cleanup()
# ruff: noqa  (verbatim from the seed document, kept as written: it is a lint fixture)
