"""Written for disttrain in the shape of the vision reference training scripts: prints
through the helper's rank-0 print, a cached dataset and a checkpoint holding the args."""

import argparse
import os

import torch
import torchvision
import vision_utils as utils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def load_data(traindir, args):
    cache_path = os.path.join(args.cache_dir, "train.pt")
    if args.cache_dataset and os.path.exists(cache_path):
        print(f"Loading dataset_train from {cache_path}")
        dataset, _ = torch.load(cache_path)
    else:
        dataset = torchvision.datasets.ImageFolder(traindir)
        if args.cache_dataset:
            utils.save_on_master((dataset, traindir), cache_path)
    return dataset, DistributedSampler(dataset)


def main(args):
    utils.init_distributed_mode(args)
    dataset, sampler = load_data(args.data_path, args)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model = DDP(torchvision.models.resnet18().cuda(args.gpu), device_ids=[args.gpu])
    model_without_ddp = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * args.world_size)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        args.start_epoch = checkpoint["epoch"] + 1
    print("Start training")
    for epoch in range(args.start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for image, target in loader:
            loss = torch.nn.functional.cross_entropy(model(image.cuda()), target.cuda())
            optimizer.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                if args.clip_grad_norm is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
        checkpoint = {"model": model_without_ddp.state_dict(),
                      "optimizer": optimizer.state_dict(), "epoch": epoch, "args": args}
        utils.save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        print(f"Epoch {epoch} done")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    main(parser.parse_args())
