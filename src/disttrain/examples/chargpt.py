"""chargpt: a small GPT trained as a character-level language model, as a TrainTask.

    disttrain run --example chargpt                       # 2 processes on this machine
    disttrain run --task disttrain.examples.chargpt:make_task --task-args '{"layers": 4}'

The text is the Python documentation that ships with every Python (`pydoc_data.topics`,
about 465,000 characters), so nothing is downloaded. The last tenth is held out; the eval
loss is in nats per character. For scale: a character bigram model fitted and scored on the
whole text (`bigram_nats`, about 2.46 nats) is a bound no held-out bigram beats; this model
goes well below it within a minute on two CPU cores. Unlike the single-bucket SimpleNet it
has many parameter tensors, so DDP's bucketing and its overlap of all-reduce with backward
matter here.

The model is plain torch (no new dependency): token and position embeddings, pre-norm
blocks of causal self-attention (`scaled_dot_product_attention`) and an MLP, a tied head.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from disttrain.train.task import TrainTask


# -- data ----------------------------------------------------------------------------------
def load_text() -> str:
    """The pydoc topics in a fixed order (their dict order is not a contract)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharWindows(Dataset):
    """Windows of `block` characters and the same window shifted by one (the targets),
    starting every `stride` characters of `codes`."""

    def __init__(self, codes: torch.Tensor, block: int, stride: int):
        if len(codes) <= block:
            raise ValueError(f"text of {len(codes)} characters is shorter than one window of {block + 1}")
        self.codes, self.block, self.stride = codes, block, stride
        self.n = (len(codes) - block - 1) // stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        chunk = self.codes[s:s + self.block + 1]
        return chunk[:-1], chunk[1:]


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), vocab


def bigram_nats(text: str) -> float:
    """Cross-entropy (nats per character) of a character bigram model fitted on `text` and
    scored on the same text: a lower bound for any bigram model on any part of it."""
    pairs = Counter(pairwise(text))
    firsts = Counter(text[:-1])
    n = len(text) - 1
    return -sum(c * math.log(c / firsts[a]) for (a, _), c in pairs.items()) / n


# -- model -----------------------------------------------------------------------------------
class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # chunk and -1, not split(c) and c // heads: under tensor parallel this rank's qkv
        # output holds its own heads only (`heads` is then the local count)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A GPT over `vocab` characters with a context of `block` characters."""

    def __init__(self, vocab: int, block: int = 64, layers: int = 3, width: int = 96, heads: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight   # tied: fewer parameters, the same quality here
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy of logits against targets (nats per character).
    The task's loss_fn, so that pipeline parallel can run it on the last stage alone."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def lm_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-character cross-entropy of a batch of windows (nats per character)."""
    x, y = batch
    return lm_loss(model(x), y)


# -- the task ---------------------------------------------------------------------------------
def make_task(block: int = 64, layers: int = 3, width: int = 96, heads: int = 4, dropout: float = 0.0,
              stride: int | None = None, eval_fraction: float = 0.1) -> TrainTask:
    """chargpt as a TrainTask: train on the first 90% of the text, evaluate on the rest.

    Args:
        block: context length in characters (one window's length).
        layers, width, heads, dropout: the transformer's shape.
        stride: characters between the starts of two training windows. The default,
            `2 * block`, takes every other window: an epoch is then ~3,300 windows, so
            the spec's default 10 epochs at 2 processes take about a minute on two CPU
            cores (~500-600 windows/s) and end near 1.7 nats. `stride=block` makes every
            character a target once per epoch (twice the time per epoch).
        eval_fraction: the held-out tail of the text.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if stride is not None and stride < 1:
        raise ValueError(f"stride must be at least 1 character, got {stride}")
    codes, vocab = encode(load_text())
    cut = int(len(codes) * (1.0 - eval_fraction))
    train = CharWindows(codes[:cut], block, stride or 2 * block)
    held_out = CharWindows(codes[cut:], block, block)
    return TrainTask(
        model=lambda: CharGPT(len(vocab), block, layers, width, heads, dropout),
        train_data=train, eval_data=held_out, loss_fn=lm_loss,
        fsdp_block=Block, name="chargpt")
