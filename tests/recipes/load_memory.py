"""Measuring the host memory of loading a pretrained model into 2 ranks (the recipe's
load-once against every rank's `from_pretrained`): used by tests/recipes/test_load_memory.py
and benchmarks/finetune_load_memory.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_model(folder: Path, layers: int, hidden: int, file_dtype: str = "bfloat16") -> int:
    """A random Llama-style model (and a tokenizer) in `folder`, its file in `file_dtype`
    (bf16, as models are published); returns the bytes of its weights in fp32, the dtype
    the recipe trains in by default."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.recipes.hf_fixtures import corpus, make_tokenizer

    tokenizer = make_tokenizer(corpus(5000), 256)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to(getattr(torch, file_dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return size


def load_once(model_dir: str, strategy: str) -> dict[str, int]:
    """In a rank: build on meta, then load once; the load's peak anonymous RSS delta."""
    from disttrain.distributed.strategies import WrapOptions, wrap
    from disttrain.recipes.causal_lm import _block_classes, go_offline
    from disttrain.recipes.host_memory import AnonPeak
    from disttrain.recipes.load_once import Pretrained
    from disttrain.testing import setup_for_test

    go_offline()
    with setup_for_test() as rt:
        pretrained = Pretrained(Path(model_dir))
        model = pretrained.build()
        opts = WrapOptions(fsdp_unit_types=_block_classes(Path(model_dir)))
        rt.barrier()
        # DDP's wrapper allocates its gradient buckets (a second copy, on the device): that is
        # training memory whatever loaded the weights, so the ddp figure leaves it out.
        wrapper = (lambda m: m) if strategy == "ddp" else (lambda m: wrap(m, strategy, rt, opts))
        with AnonPeak() as peak:
            model = pretrained.load(model, rt, strategy, wrapper)
            rt.barrier()
        held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
                   else p.numel() * p.element_size() for p in model.parameters())
        return {"peak_delta": peak.delta_bytes, "params_held": held}


def every_rank_from_pretrained(model_dir: str) -> int:
    """One process's peak anonymous RSS delta of `from_pretrained` (run in a fresh process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from disttrain.recipes.host_memory import AnonPeak

    with AnonPeak() as peak:   # the dtype the recipe trains in (its default)
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peak.delta_bytes


def measure(model_dir: Path, strategy: str, world: int = 2) -> dict[str, Any]:
    import multiprocessing as mp

    from disttrain.testing import run_ranks

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ranks = run_ranks(world, load_once, str(model_dir), strategy, timeout_s=300)
    with mp.get_context("spawn").Pool(1) as pool:   # a fresh process: a clean heap
        one = pool.apply(every_rank_from_pretrained, (str(model_dir),))
    return {"recipe": sum(r["peak_delta"] for r in ranks.values()),
            "recipe_per_rank": [ranks[r]["peak_delta"] for r in sorted(ranks)],
            "held_per_rank": [ranks[r]["params_held"] for r in sorted(ranks)],
            "every_rank": one * world}
