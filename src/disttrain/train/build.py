"""Assemble a Trainer from a JobSpec: workload, strategy, optimizer, schedule, writer.

    trainer = build_trainer(spec, rt)     # rt = disttrain.distributed.runtime.setup(...)

Kept apart from the loop (torchtitan keeps config, parallelism and loop apart) so that
`Trainer` only stores already-built parts and tests can build one from pieces. Today the
model and data are always a built-in workload's (`examples.workload.build_workload`);
everything after that step is the same for any model. Choices made here, each printed in
the start banner and stored in summary.json (`RunInfo`):
- the strategy that really runs (`resolve_strategy`: ddp/fsdp at world size 1 and dp
  with < 2 GPUs run as none, without a wrapper);
- the comm hook (DDP) or gradient reduce dtype (FSDP), with bytes counted per step;
- the LR scaled with the global batch = batch x world size x grad_accum (linear scaling
  by default: a bigger batch takes fewer, larger steps; docs/strategies.md).
"""

from __future__ import annotations

import torch

from disttrain.distributed.activation_ckpt import enable_grad_ckpt
from disttrain.distributed.comm_hooks import CommStats, register_comm_hook
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import (
    WrapOptions,
    dp_gpu_count,
    resolve_strategy,
    wrap,
)
from disttrain.errors import SpecError
from disttrain.examples.workload import build_workload
from disttrain.rundir import RunWriter, open_writer
from disttrain.spec.job import JobSpec, TrainSpec
from disttrain.spec.rules import check_runnable
from disttrain.train.optim import build_optimizer, describe, global_batch, scaled_lr, warmup_lambda
from disttrain.train.precision import Precision
from disttrain.train.run_info import RunInfo
from disttrain.train.trainer import Trainer

__all__ = ["build_trainer", "planned_steps"]
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def planned_steps(cfg: TrainSpec, batches_per_epoch: int) -> int:
    """Optimizer steps the run will take (an epoch's short last group is one step)."""
    per_epoch = -(-batches_per_epoch // cfg.grad_accum)
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps else total


def build_trainer(spec: JobSpec, rt: Runtime, writer: RunWriter | None = None) -> Trainer:
    """Everything the built-in job needs, on this rank's device.

    The model and data come from the built-in workload the spec names
    (`examples.workload.build_workload`); the rest (strategy, comm hook, optimizer, LR
    schedule, precision, writer) is built here the same way for any model.

    Args:
        spec: the job (its `train` section and `example`).
        rt: this process's runtime.
        writer: rank 0's run-directory writer (default: created here on rank 0).

    Raises:
        StrategyError, PrecisionError: a combination this runtime cannot run.
    """
    cfg = spec.train
    if spec.script:
        raise SpecError("build_trainer runs the built-in examples; scripts run via torchrun")
    # The same host rules `disttrain run` applied before launch, now with this rank's view.
    notes = check_runnable(spec, gpus=dp_gpu_count(rt), world_size=rt.world_size)
    strategy, note = resolve_strategy(cfg.strategy, rt)
    notes += [note] if note else []
    precision = Precision.create(cfg.precision, rt.device, sharded=strategy == "fsdp")
    workload = build_workload(spec, rt)
    model = workload.model
    if cfg.grad_ckpt:
        notes.append(f"activation checkpointing: {enable_grad_ckpt(model)}")
    opts = WrapOptions(fsdp_sharding=cfg.fsdp_sharding,
                       fsdp_reduce_dtype=REDUCE_DTYPES.get(cfg.comm_hook))
    fsdp_bytes = _fsdp_bytes(model, strategy, cfg.comm_hook)  # before sharding: full sizes
    model = wrap(model, strategy, rt, opts)
    loader = workload.loader
    comm: CommStats | None = None
    if strategy == "ddp":
        comm = register_comm_hook(model, cfg.comm_hook, planned_steps(cfg, len(loader)),
                                  poll=rt.backend == "gloo")
    elif cfg.comm_hook != "none" and strategy != "fsdp":
        notes.append(f"comm_hook {cfg.comm_hook}: only DDP communicates gradients; ignored "
                     f"with strategy {strategy}")
    lr = scaled_lr(cfg.lr, cfg.lr_scaling, cfg.batch_size, rt.world_size, cfg.grad_accum)
    if cfg.warmup_steps:
        notes.append(f"lr warm-up: linear from {lr / cfg.warmup_steps:g} to {lr:g} over "
                     f"{cfg.warmup_steps} optimizer steps")
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.warmup_steps))
    if writer is None and rt.is_rank0:
        writer = open_writer(spec.run_dir, spec.to_yaml())
    info = RunInfo(
        name=spec.name, workload=workload.name, strategy=cfg.strategy,
        strategy_effective=strategy, backend=rt.backend, device=str(rt.device),
        world_size=rt.world_size, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
        global_batch=global_batch(cfg.batch_size, rt.world_size, cfg.grad_accum),
        lr_base=cfg.lr, lr_effective=lr, lr_scaling=cfg.lr_scaling,
        warmup_steps=cfg.warmup_steps, precision=cfg.precision,
        comm_hook=cfg.comm_hook if strategy in ("ddp", "fsdp") else "none",
        optimizer=describe(optimizer), torch_version=torch.__version__,
        train_samples=workload.train_samples, test_samples=workload.test_samples,
        data_preloaded=workload.data_preloaded, allreduce_bytes_per_step=fsdp_bytes,
        run_dir=spec.run_dir, notes=notes,
    )
    for line in notes:
        rt.print0(line)
    return Trainer(rt=rt, cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=loader, test_x=workload.test_x, test_y=workload.test_y,
                   precision=precision, writer=writer, info=info, comm=comm)


def _fsdp_bytes(model: torch.nn.Module, strategy: str, comm_hook: str) -> int:
    """FSDP's reduce-scatter bytes per step, computed (FSDP has no comm hook to count
    with); DDP's are measured by its comm hook and put in the summary by the Trainer."""
    if strategy != "fsdp":
        return 0
    from disttrain.distributed.fsdp import reduced_grad_bytes

    return reduced_grad_bytes(model, REDUCE_DTYPES.get(comm_hook))

