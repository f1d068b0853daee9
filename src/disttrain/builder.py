"""Assemble a Trainer from a JobSpec: data, model, strategy, optimizer, schedule, writer.

    trainer = build_trainer(spec, rt)     # rt = disttrain.runtime.setup(...)

Kept apart from the loop (torchtitan keeps config, parallelism and loop apart) so that
`Trainer` only stores already-built parts and tests can build one from pieces.
"""

from __future__ import annotations

import torch

from disttrain.data import ShardedLoader, load_dataset
from disttrain.models import build_model
from disttrain.report import RunWriter
from disttrain.runtime import Runtime, seed_everything
from disttrain.spec import JobSpec
from disttrain.strategies import WrapOptions, wrap
from disttrain.trainer import Trainer
from disttrain.tuning import Precision, global_batch, scaled_lr, warmup_lambda


def build_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def build_trainer(spec: JobSpec, rt: Runtime, writer: RunWriter | None = None) -> Trainer:
    """Everything the built-in job needs, on this rank's device.

    Args:
        spec: the job (its `train` section and `example`).
        rt: this process's runtime.
        writer: rank 0's run-directory writer (default: created here on rank 0).
    """
    cfg = spec.train
    if spec.script:
        raise ValueError("build_trainer runs the built-in examples; scripts run via torchrun")
    example = spec.workload
    splits = load_dataset(example, data_dir=cfg.data_dir, download=cfg.download and rt.is_rank0,
                          num_samples=cfg.num_samples, input_size=cfg.input_size)
    # Same seed on every rank: identical initial weights (DDP would broadcast anyway).
    seed_everything(cfg.seed)
    model = build_model(example, cfg.input_size or splits.input_size, cfg.hidden_size,
                        splits.num_classes)
    if cfg.grad_ckpt and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    model = wrap(model, cfg.strategy, rt, WrapOptions())
    lr = scaled_lr(cfg.lr, cfg.lr_scaling, cfg.batch_size, rt.world_size, cfg.grad_accum)
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.warmup_steps))
    loader = ShardedLoader(splits.train_x, splits.train_y, cfg.batch_size, rt.rank,
                           rt.world_size, shuffle=True, seed=cfg.seed)
    if writer is None and rt.is_rank0:
        writer = RunWriter(spec.run_dir)
        if not (spec.run_dir / "job.yaml").exists():
            writer.write_spec(spec.to_yaml())
    info = {
        "name": spec.name, "workload": example, "strategy": cfg.strategy,
        "backend": rt.backend, "device": str(rt.device), "world_size": rt.world_size,
        "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
        "global_batch": global_batch(cfg.batch_size, rt.world_size, cfg.grad_accum),
        "lr_base": cfg.lr, "lr_effective": lr, "lr_scaling": cfg.lr_scaling,
        "precision": cfg.precision, "torch_version": torch.__version__,
        "train_samples": len(splits.train_x), "test_samples": len(splits.test_x),
        "allreduce_bytes_per_step": _grad_bytes(model) if rt.world_size > 1 else 0,
        "run_dir": spec.run_dir,
    }
    return Trainer(rt=rt, cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=loader, test_x=splits.test_x, test_y=splits.test_y,
                   precision=Precision.create(cfg.precision, rt.device), writer=writer,
                   info=info)


def _grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes one all-reduce moves per optimizer step (no compression hook)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
