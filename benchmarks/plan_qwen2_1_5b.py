"""How long `disttrain plan` takes, and how much host memory, on a 1.5-billion-parameter
decoder built from a Qwen2-1.5B-shaped `transformers` config (no weights anywhere: the
model is made on the meta device and traced on fake tensors). Issue 22's bar: under 60 s
and 3 GiB on the development machine. A measurement, not a test: it prints the figures.

    .venv/bin/python benchmarks/plan_qwen2_1_5b.py [--seq 1024] [--batch 4] [--gpumem 24000]

It runs the real CLI (`disttrain plan --task benchmarks/plan_qwen2_1_5b.py:make_task`)
in a child process and reads its peak RSS from the kernel (getrusage of the children).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from disttrain.train.task import TrainTask

HERE = Path(__file__).resolve().parent
# Qwen2-1.5B's published shape (its config.json on the Hub): hidden 1536, 28 layers,
# 12 heads, 2 KV heads, MLP 8960, vocabulary 151936, tied embeddings.
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, tie_word_embeddings=True,
                  attention_dropout=0.0, use_cache=False)


class RandomTokens(Dataset):
    """Token windows of random ids: the shape of a real batch, no data read."""

    def __init__(self, seq: int, n: int = 64, vocab: int = 151936) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def lm_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def make_task(seq: int = 1024) -> TrainTask:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    config = Qwen2Config(**QWEN2_1_5B)
    return TrainTask(model=lambda: Qwen2ForCausalLM(config), train_data=RandomTokens(seq),
                     step_fn=lm_step, fsdp_block=Qwen2DecoderLayer, name="qwen2-1.5b-shape")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gpumem", default=None, help="a slice to check (then a search for the "
                    "flags that fit runs when it does not: one more trace per combination)")
    ap.add_argument("--extra", nargs="*", default=["--precision", "bf16", "--grad-ckpt"])
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "disttrain.cli.main", "plan", "--task",
           "plan_qwen2_1_5b:make_task",
           "--task-args", f"{{seq: {args.seq}}}", "--batch-size", str(args.batch),
           "--gpus", "1", "--nproc-per-node", "1",
           *(["--gpumem", args.gpumem] if args.gpumem else []), *args.extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss_gib = usage.ru_maxrss / 2**20
    print(done.stdout + done.stderr)
    print(f"disttrain plan on a Qwen2-1.5B-shaped model (seq {args.seq}, batch {args.batch}, "
          f"{' '.join(args.extra)}): {wall:.1f} s wall, {usage.ru_utime + usage.ru_stime:.1f} s "
          f"CPU, peak host RSS {rss_gib:.2f} GiB, exit {done.returncode}")
    return 0 if done.returncode in (0, 1) else done.returncode


if __name__ == "__main__":
    sys.exit(main())
