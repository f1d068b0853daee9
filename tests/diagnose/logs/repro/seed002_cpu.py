import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def setup(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

def train(rank, world_size):
    setup(rank, world_size)

    # 创建模型并移动到GPU
    model = torch.nn.Linear(1000, 10)
    model = torch.nn.parallel.DistributedDataParallel(model)

    # 定义优化器和损失函数
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.CrossEntropyLoss()

    # 模拟训练数据
    for epoch in range(5):
        # 生成随机数据
        data = torch.randn(32, 1000)
        target = torch.randint(0, 10, (32,))

        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()

        if rank == 0:
            print(f"Epoch {epoch}, Loss: {loss.item()}")

    cleanup()

if __name__ == "__main__":
    world_size = 2
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
