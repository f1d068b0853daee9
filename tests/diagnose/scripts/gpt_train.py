"""Written for disttrain in the shape of a popular single-file GPT trainer: globals as the
config (overridden by an exec'd configurator), the backend in a variable, clipping under
`if grad_clip:` after unscale_."""

import os

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = "out"
grad_clip = 1.0
accum = 4
backend = "nccl"
device = "cuda"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
exec(open("gpt_configurator.py").read())  # noqa: SIM115 (the idiom itself)

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = int(os.environ["RANK"]) == 0
else:
    master_process = True
device_type = "cuda" if "cuda" in device else "cpu"

model = torch.nn.Linear(8, 8).to(device)
optimizer = model.configure_optimizers(device_type)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model

for it in range(100):
    if it % 10 == 0 and master_process:
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}
        print(f"saving checkpoint to {out_dir}")
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for _ in range(accum):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8, device=device)).sum() / accum
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

if ddp:
    destroy_process_group()
