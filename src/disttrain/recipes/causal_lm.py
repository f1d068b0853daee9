"""Fine-tune a pretrained causal language model from a local directory: LoRA or full.

    disttrain run --task disttrain.recipes.causal_lm:make_task \\
        --task-args '{"model": "/models/Qwen2.5-0.5B", "data": "/data/train.jsonl", "lora": {"r": 8}}' \\
        --output-dir /output/qwen-lora --strategy ddp --precision bf16
    disttrain finetune /models/Qwen2.5-0.5B /data/train.jsonl --output-dir /output/qwen-lora

A TrainTask like any other (docs/your-model.md), so the Trainer's guarantees hold: exact
mid-epoch resume, one all-reduce per optimizer step, the sync check, the run directory.
What the recipe adds (docs/finetune.md):

- `model`: a directory in Hugging Face layout (config.json, *.safetensors, tokenizer files),
  as ModelScope and the HF mirror download them; never the network (HF_HUB_OFFLINE=1);
- the weights are read once per node under DDP (local rank 0, sent within the node), once
  per job under FSDP2 (rank 0, each rank keeps its shard) (`recipes/load_once.py`);
- `data`: .txt / .jsonl / a folder of them, tokenized once per node into a cache and cut
  into windows of `seq_len` tokens (`recipes/text_data.py`);
- `lora`: false (full fine-tuning) or {r, alpha, dropout, target_modules} (peft; target
  modules default to peft's table per architecture); only the adapter is trained, so the
  frozen base is neither all-reduced (DDP reduces parameters that need a gradient) nor in
  the optimizer state (the optimizer gets the trainable parameters only), nor in the
  checkpoints (`save_frozen=False`: the adapter, its optimizer state and the position);
- at the end the model is written to `train.output_dir` in Hugging Face format
  (`recipes/hf_save.py`) and summary.json's `eval` gets `perplexity`.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain import envvars
from disttrain.train.task import TaskError, TrainTask, task_hooks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "special_tokens_map.json")
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}


def go_offline() -> None:
    """The Hugging Face libraries never touch the network in a rank: a missing file is an
    error, not a download (the cluster has no route out; HF_ENDPOINT mirrors are for
    downloading models beforehand)."""
    import os

    for name in (envvars.HF_HUB_OFFLINE, envvars.TRANSFORMERS_OFFLINE):
        if os.environ.get(name) != "1":
            envvars.set_env(name, "1")


def check_model_dir(model: str | Path) -> Path:
    """The model directory, checked: config.json, weights and tokenizer files present.

    Raises:
        TaskError: what is missing, the file and the directory named.
    """
    from disttrain.recipes.load_once import weight_files

    path = Path(model)
    if not path.is_dir():
        where = path.parent if path.parent.is_dir() else "a missing folder"
        raise TaskError(f"model: {path.name} is not a directory in {where}; give a local model "
                        f"directory in Hugging Face layout (config.json, *.safetensors, tokenizer)")
    if not (path / "config.json").is_file():
        raise TaskError(f"model: config.json is missing from {path}")
    weight_files(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                    "tokenizer.model", "vocab.json")):
        raise TaskError(f"model: no tokenizer (tokenizer.json or tokenizer_config.json) in {path}")
    return path


def lora_settings(lora: Any) -> Any:
    """`lora` task argument -> LoraSettings, or None for full fine-tuning."""
    from disttrain.recipes.load_once import LoraSettings

    if lora is False or lora is None:
        return None
    if lora is True:
        lora = {}
    if not isinstance(lora, Mapping):
        raise TaskError(f"lora: give false (full fine-tuning) or a mapping of "
                        f"{', '.join(sorted(LORA_KEYS))}, got {lora!r}")
    unknown = sorted(set(lora) - LORA_KEYS)
    if unknown:
        raise TaskError(f"lora: unknown key(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(sorted(LORA_KEYS))}")
    targets = lora.get("target_modules")   # a list of names, or a string peft takes:
    if targets is not None and not isinstance(targets, str):   # "all-linear", a regex
        targets = tuple(targets)
    try:
        settings = LoraSettings(r=int(lora.get("r", 8)), alpha=int(lora.get("alpha", 16)),
                                dropout=float(lora.get("dropout", 0.0)),
                                target_modules=targets or None)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"lora: {exc}") from None
    if settings.r < 1 or not 0.0 <= settings.dropout < 1.0:
        raise TaskError(f"lora: r must be >= 1 and dropout in [0, 1), got r={settings.r}, "
                        f"dropout={settings.dropout}")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise TaskError("lora needs the peft package: pip install 'disttrain[peft]'") from None
    return settings


def causal_lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """The library's own causal-LM loss (it shifts the labels itself)."""
    outputs = model(**batch)
    return outputs.loss, outputs


def token_nll(outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood, predicted tokens): the exact per-token mean over the
    eval set, padding excluded; perplexity = exp of it."""
    logits = outputs.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            ignore_index=-100, reduction="sum")
    return nll, (labels != -100).sum()


def check_args(model: str, data: str, seq_len: int = 512, eval_fraction: float = 0.05,
               lora: Any = False, dtype: str = "float32", merge_lora: bool = False,
               **_: Any) -> None:
    """The recipe's arguments, checked before any process starts (`disttrain run` calls it:
    train/task.py's task_hooks): files named with their folder, exit 2, nothing written."""
    from disttrain.recipes import text_data

    check_model_dir(model)
    text_data.text_files(data)
    if not isinstance(seq_len, int) or seq_len < 2:
        raise TaskError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    if not 0.0 <= float(eval_fraction) < 1.0:
        raise TaskError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    if dtype not in DTYPES:
        raise TaskError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if merge_lora and lora_settings(lora) is None:
        raise TaskError("merge_lora applies to LoRA only: set lora, or drop merge_lora")
    lora_settings(lora)


@task_hooks(check=check_args)
def make_task(model: str, data: str, seq_len: int = 512, packing: bool = True,
              eval_fraction: float = 0.05, lora: Any = False, text_field: str = "text",
              dtype: str = "float32", merge_lora: bool = False, cache_dir: str | None = None,
              cache_wait_s: float = 600.0) -> TrainTask:
    """A TrainTask that fine-tunes the causal LM in `model` on the text in `data`.

    Args:
        model: a local model directory in Hugging Face layout.
        data: a .txt file, a .jsonl file (one document per line, in `text_field`), or a
            folder of them.
        seq_len: tokens per training window.
        packing: concatenate documents (EOS between) into full windows; False: one
            document per window, padded.
        eval_fraction: the share of windows held out for evaluation (0: none).
        lora: false for full fine-tuning, or {r, alpha, dropout, target_modules}.
        text_field: the .jsonl field holding the text.
        dtype: the parameters' dtype: float32, or bfloat16 (a frozen base in half the memory).
        merge_lora: save the base with the adapter merged in, instead of the adapter alone.
        cache_dir: where the token cache goes (default: the system's temp folder).
        cache_wait_s: how long ranks wait for local rank 0's token cache.
    """
    go_offline()
    from disttrain.recipes import text_data
    from disttrain.recipes.load_once import Pretrained

    check_args(model, data, seq_len, eval_fraction, lora, dtype, merge_lora)
    model_dir, files, settings = Path(model), text_data.text_files(data), lora_settings(lora)
    pretrained = Pretrained(model_dir, dtype=DTYPES[dtype], lora=settings)

    tokenizer = _tokenizer(model_dir)
    key = text_data.cache_key(files, [p for p in (model_dir / n for n in TOKENIZER_FILES)
                                      if p.is_file()],
                              {"text_field": text_field, "eos": tokenizer.eos_token_id})
    folder = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "disttrain-token-cache"
    ids, starts = text_data.token_cache(files, tokenizer, folder, key, text_field,
                                        writer=int(envvars.int_var(envvars.LOCAL_RANK, 0)) == 0,
                                        wait_s=cache_wait_s)
    spans = text_data.window_spans(len(ids), starts, seq_len, packing)
    if len(spans) == 0:
        raise TaskError(f"data: {len(ids)} token(s) in {data}, not one window of seq_len={seq_len}")
    train_spans, eval_spans = text_data.split(spans, float(eval_fraction))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def on_end(model_: nn.Module, rt: Any, output_dir: Path | None, last_eval: dict[str, float]
               ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "token_nll" in last_eval:
            out["eval"] = {**last_eval, "perplexity": math.exp(min(last_eval["token_nll"], 700.0))}
        if output_dir is not None:
            from disttrain.recipes.hf_save import save_model

            out.update(save_model(model_, pretrained, rt, output_dir, merge=merge_lora))
        return out

    return TrainTask(
        model=pretrained.build,
        train_data=text_data.TokenWindows(ids, train_spans, seq_len, pad),
        eval_data=text_data.TokenWindows(ids, eval_spans, seq_len, pad) if len(eval_spans) else None,
        step_fn=causal_lm_step, metrics={"token_nll": token_nll},
        fsdp_block=_block_classes(model_dir), name=f"finetune-{model_dir.name}",
        load_weights=pretrained.load, on_end=on_end,
        # LoRA: the base comes back from `model` at every start, so checkpoints hold the
        # adapter, its optimizer state and the position only (train/ckpt_trainable.py)
        save_frozen=settings is None,
    )


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise TaskError(f"model: the tokenizer in {model_dir} does not load ({exc})") from None


def _block_classes(model_dir: Path) -> tuple[type, ...] | None:
    """The model's transformer block class(es) (its `_no_split_modules`): one FSDP unit each."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise TaskError(f"model: {model_dir / 'config.json'} names model_type "
                        f"{getattr(config, 'model_type', '?')!r}, which this transformers "
                        f"has no causal-LM class for") from None
    module = sys.modules[cls.__module__]
    found = tuple(getattr(module, name) for name in (cls._no_split_modules or [])
                  if isinstance(getattr(module, name, None), type))
    return found or None
