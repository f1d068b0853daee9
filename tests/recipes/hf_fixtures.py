"""Tiny pretrained-looking models for the causal-LM recipe's tests, made here, no download.

    model_dir = make_model_dir(tmp, "gpt2")     # config.json + model.safetensors + tokenizer
    data = write_jsonl(tmp / "train.jsonl")     # documents of the stdlib's pydoc text

The tokenizer is a word-level vocabulary trained on the test text with the `tokenizers`
library and wrapped in transformers' PreTrainedTokenizerFast; the models are random
GPT2-style and Llama-style decoders saved with `save_pretrained`, as a model directory
from ModelScope or the HF mirror would look.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("gpt2", "llama")


def corpus(chars: int = 40_000) -> list[str]:
    """Documents: pydoc topics (shipped with CPython), cut to `chars` characters."""
    from pydoc_data.topics import topics

    docs, total = [], 0
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        docs.append(text[:2000])
        total += len(docs[-1])
        if total >= chars:
            break
    return docs


def write_jsonl(path: Path, docs: list[str] | None = None) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in (docs or corpus())))
    return path


def make_tokenizer(docs: list[str], vocab: int = 256):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")


def make_model_dir(root: Path, arch: str, hidden: int = 32, layers: int = 2, vocab: int = 256,
                   seed: int = 0, docs: list[str] | None = None) -> Path:
    """A random `arch` decoder and its tokenizer, saved in Hugging Face layout under root/arch."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    tokenizer = make_tokenizer(docs or corpus(), vocab)
    n = len(tokenizer)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=n, n_positions=128, n_embd=hidden, n_layer=layers, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    elif arch == "llama":
        config = LlamaConfig(vocab_size=n, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128, tie_word_embeddings=False,
                             bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = root / arch
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_job_root(root: Path, hidden: int = 32) -> Path:
    """A fine-tuning job's inputs under root: train.jsonl and one model directory per
    architecture in ARCHS, all from one corpus (so the tokenizers match the data)."""
    docs = corpus()
    write_jsonl(root / "train.jsonl", docs)
    for arch in ARCHS:
        make_model_dir(root, arch, hidden=hidden, docs=docs)
    return root
