"""Written for disttrain in the shape of a Hugging Face Accelerate training script."""

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

logger = get_logger(__name__)


def main():
    accelerator = Accelerator()
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(10):
        loss = model(torch.randn(4, 8, device=accelerator.device)).sum()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        logger.info(f"step {step}")
        print(f"step {step} loss {loss.item():.4f}")
        accelerator.print("printed once")
    if accelerator.is_main_process:
        print("done")


if __name__ == "__main__":
    main()
