"""`disttrain finetune MODEL DATA`: `disttrain run` of the causal-LM recipe, in fewer words.

    disttrain finetune /models/Qwen2.5-0.5B /data/train.jsonl --output-dir /output/qwen-lora
    disttrain finetune /models/Qwen2.5-0.5B /data --full --strategy fsdp --precision bf16

is `disttrain run --task disttrain.recipes.causal_lm:make_task --task-args '{"model": MODEL,
"data": DATA, "lora": {"r": 8}}' ...`: every run flag applies, `--task-args` adds the
recipe's other arguments (docs/finetune.md). `--task` is refused: this verb runs the recipe.
"""

from __future__ import annotations

from typing import Any

import click

from disttrain.cli.options import SpecCommand, SpecFile, fail, spec_options

RECIPE = "disttrain.recipes.causal_lm:make_task"


@click.command(cls=SpecCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.argument("data")
@click.option("--full", is_flag=True, help="full fine-tuning (default: LoRA)")
@click.option("--lora-r", type=click.IntRange(min=1), default=None,
              help="LoRA rank (default 8; alpha 2r)")
@click.option("--seq-len", type=click.IntRange(min=2), default=None,
              help="tokens per training window (default 512)")
@click.option("-f", "--file", "spec_file", type=SpecFile(),
              help="job spec YAML; flags override its fields")
@click.option("--dry-run", is_flag=True, help="print the resolved spec and torchrun command")
@spec_options([None, "launch", "train"])
@click.pass_context
def finetune(ctx: click.Context, model: str, data: str, full: bool, lora_r: int | None,
             seq_len: int | None, spec_file: str | None, dry_run: bool, **kwargs: Any) -> None:
    """Fine-tune the pretrained causal LM in MODEL (a local Hugging Face directory) on DATA
    (.txt, .jsonl or a folder of them): LoRA by default, --full for every weight; the model
    lands in --output-dir in Hugging Face format (docs/finetune.md)."""
    from disttrain.cli.run_cmd import run

    if kwargs.get("task") not in (None, RECIPE):
        fail(f"--task: finetune runs {RECIPE}; use `disttrain run --task ...` for another task")
    if full and lora_r is not None:
        fail("--lora-r applies to LoRA: drop it, or drop --full")
    args = dict(kwargs.get("task_args") or {})
    args.update(model=model, data=data)
    if full:
        args["lora"] = False
    else:
        lora = args["lora"] if isinstance(args.get("lora"), dict) else {}
        r = lora_r or lora.get("r", 8)
        args["lora"] = {**lora, "r": r, "alpha": lora.get("alpha", 2 * r)}
    if seq_len is not None:
        args["seq_len"] = seq_len
    kwargs.update(task=RECIPE, task_args=args)
    ctx.invoke(run, script=None, script_args=(), spec_file=spec_file, dry_run=dry_run, **kwargs)

