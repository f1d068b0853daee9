"""Small tasks the plan tests trace and run: a dict-batch task and a tiny transformers GPT2
(the shape of tests/train/test_hf_task.py's), besides the built-in SimpleNet and chargpt."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from disttrain.train.task import TrainTask

BLOCK = 32


class DictRows(Dataset):
    """Rows as dicts {"features", "label"}: the default collate makes dict batches."""

    def __init__(self, n: int = 512, width: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "label": self.y[i]}


class Tower(nn.Module):
    def __init__(self, width: int = 48, hidden: int = 384) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(width, hidden), nn.GELU())
        self.mid = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
        self.out = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x)))


def dict_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["features"]), batch["label"])


def dict_task() -> TrainTask:
    return TrainTask(model=Tower, train_data=DictRows(), step_fn=dict_step, name="dict-rows")


def gpt2_model(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def hf_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, _ = batch
    return model(input_ids=x, labels=x).loss


def gpt2_task() -> TrainTask:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from disttrain.examples.chargpt import CharWindows, encode, load_text

    codes, vocab = encode(load_text())
    return TrainTask(model=lambda: gpt2_model(len(vocab)),
                     train_data=CharWindows(codes[:20000], BLOCK, BLOCK),
                     step_fn=hf_step, fsdp_block=GPT2Block, name="hf-gpt2")


def chargpt_task() -> TrainTask:
    from disttrain.examples.chargpt import make_task

    return make_task(block=64, layers=2, width=64, heads=4)


def simplenet_task() -> TrainTask:
    from disttrain.examples.digits import make_task

    return make_task()


TASKS = {"simplenet": simplenet_task, "chargpt": chargpt_task, "gpt2": gpt2_task,
         "dict": dict_task}
