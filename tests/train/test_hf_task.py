"""A model from another library trains unchanged: a tiny, randomly initialised
`transformers` GPT2LMHeadModel on chargpt's text, through a TrainTask whose step_fn is the
library's own loss (`model(input_ids=x, labels=x).loss`), on 2 real gloo ranks.

Needs the optional `hf` extra (`pip install -e '.[hf]'`); skipped without it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from disttrain.examples.chargpt import CharWindows, encode, load_text
from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test
from disttrain.train.task import TrainTask
from tests.conftest import needs

pytestmark = [needs("transformers"), pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 32
EVAL_WINDOWS = 64
SEED = 0


def gpt2(vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def hf_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # The library's own causal-LM loss: it shifts the labels itself, so the labels are
    # the input window, not CharWindows' shifted target.
    x, _ = batch
    return model(input_ids=x, labels=x).loss


def hf_task() -> TrainTask:
    codes, vocab = encode(load_text())
    held = EVAL_WINDOWS * BLOCK + 1
    return TrainTask(model=lambda: gpt2(len(vocab)),
                     train_data=CharWindows(codes[:-held], BLOCK, BLOCK),
                     eval_data=CharWindows(codes[-held:], BLOCK, BLOCK),
                     step_fn=hf_step, name="hf-gpt2")


def _train(run_dir: str) -> dict:
    from disttrain.train.build import build_trainer

    spec = JobSpec.from_dict({}, {"epochs": 1, "max_steps": 60, "batch_size": 16, "seed": SEED,
                                  "log_every_steps": 10, "checkpoint_every_epochs": 0,
                                  "run_dir": run_dir})
    with setup_for_test() as rt:
        return build_trainer(spec, rt, hf_task()).fit()


@torch.no_grad()
def _untrained_eval_loss() -> float:
    task = hf_task()
    torch.manual_seed(SEED)
    model = task.model().eval()
    loader = torch.utils.data.DataLoader(task.eval_data, batch_size=EVAL_WINDOWS)
    return sum(hf_step(model, batch).item() for batch in loader) / len(loader)


def test_transformers_gpt2_trains_on_two_ranks_in_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "hf"
    results = run_ranks(2, _train, str(run_dir), timeout_s=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["params_in_sync"] is True
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert results[0]["params_sha256"] == results[1]["params_sha256"]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    first = [r["loss"] for r in train if r["step"] == 10]
    last = [r["loss"] for r in train if r["step"] == 60]
    assert len(first) == len(last) == 2, "both ranks' losses are recorded at steps 10 and 60"
    assert sum(last) / 2 < sum(first) / 2 - 0.3, (first, last)

    before = _untrained_eval_loss()
    vocab = len(encode(load_text())[1])
    assert before == pytest.approx(math.log(vocab), abs=0.3), "a fresh model is near uniform"
    after = summary["eval"]["loss"]
    assert after < before - 0.5, (before, after)
