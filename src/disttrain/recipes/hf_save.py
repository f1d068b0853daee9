"""The fine-tuned model, saved in the format people load: a Hugging Face directory.

    save_model(model, pretrained, rt, output_dir, merge=False)   # a collective under FSDP

- full fine-tuning: `save_pretrained` of the whole model (config.json + model.safetensors),
  loadable with `AutoModelForCausalLM.from_pretrained(output_dir)`;
- LoRA: the adapter directory (adapter_config.json + adapter_model.safetensors), loadable
  with `PeftModel.from_pretrained(base, output_dir)`; with `merge` the adapter is folded
  into the base weights (peft's `merge_and_unload`) and the result saved as a full model.

The tokenizer's files are saved beside, so the directory is complete. Under FSDP the
shards are gathered to rank 0 on CPU with torch's `get_model_state_dict(full_state_dict,
cpu_offload)` (for an adapter only the trainable weights: `ignore_frozen_params`); rank 0
writes into a temporary folder beside `output_dir` and renames it into place, so a crash
mid-save leaves the previous result (or nothing), never half a model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import is_fsdp, unwrap
from disttrain.errors import CheckpointError
from disttrain.recipes.load_once import Pretrained


def gathered_state(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (CPU), {} elsewhere; a collective under FSDP."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=opts)
    bare = unwrap(model)
    if trainable_only:
        keep = {n for n, p in bare.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu() for k, v in bare.state_dict().items() if k in keep}
    return {k: v.detach().cpu() for k, v in bare.state_dict().items()}


def save_model(model: nn.Module, pretrained: Pretrained, rt: Runtime, output_dir: Path,
               merge: bool = False) -> dict[str, Any]:
    """Write the model to `output_dir` (rank 0); every rank calls it. Returns summary entries.

    Raises:
        CheckpointError: the folder cannot be written (the path and the reason named).
    """
    lora = pretrained.lora is not None
    state = gathered_state(model, trainable_only=lora and not merge)
    kind = "merged" if lora and merge else ("adapter" if lora else "full")
    if rt.is_rank0:
        tmp = output_dir.with_name(f".{output_dir.name}.{os.getpid()}.tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _write(kind, state, pretrained, tmp)
            _replace_dir(tmp, output_dir)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"train.output_dir: cannot write {output_dir} "
                                  f"({exc.strerror or exc})") from None
    rt.barrier()
    return {"output": {"dir": str(output_dir.absolute()), "format": kind}}


def _write(kind: str, state: dict[str, torch.Tensor], pretrained: Pretrained, folder: Path) -> None:
    from transformers import AutoTokenizer

    if kind == "adapter":
        peft_model = pretrained.peft_model
        peft_model.save_pretrained(str(folder), state_dict=state)
    else:
        model = _cpu_model(pretrained, state)
        if kind == "merged":
            model = model.merge_and_unload()
        model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(pretrained.model_dir)).save_pretrained(str(folder))


def _cpu_model(pretrained: Pretrained, state: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU copy of the trained model built from the gathered state (rank 0 only)."""
    copy = Pretrained(pretrained.model_dir, pretrained.dtype, pretrained.lora)
    model = copy.build_structure()
    model.load_state_dict(state, strict=False, assign=True)
    copy.hf_model.tie_weights()
    return model


def _replace_dir(new: Path, final: Path) -> None:
    """Put `new` at `final`; a previous result is moved aside first and removed after."""
    old = final.with_name(f".{final.name}.{os.getpid()}.old")
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)
