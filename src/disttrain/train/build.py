"""Assemble a Trainer from a JobSpec: data, model, strategy, optimizer, schedule, writer.

    trainer = build_trainer(spec, rt)     # rt = disttrain.distributed.runtime.setup(...)

Kept apart from the loop (torchtitan keeps config, parallelism and loop apart) so that
`Trainer` only stores already-built parts and tests can build one from pieces. Choices
made here, each printed in the start banner and stored in summary.json:
- the strategy that really runs (`resolve_strategy`: ddp/fsdp at world size 1 and dp
  with < 2 GPUs run as none, without a wrapper);
- the comm hook (DDP) or gradient reduce dtype (FSDP), with bytes counted per step;
- the LR scaled with the global batch = batch x world size x grad_accum (seed 000 §7.2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from disttrain.distributed.comm_hooks import CommStats, register_comm_hook
from disttrain.distributed.runtime import Runtime, seed_everything
from disttrain.distributed.strategies import (
    DP_ADVICE,
    StrategyError,
    WrapOptions,
    enable_grad_ckpt,
    resolve_strategy,
    wrap,
)
from disttrain.examples.models import build_model
from disttrain.rundir import RunWriter
from disttrain.spec.job import JobSpec, TrainSpec
from disttrain.train.data import ShardedLoader, Splits, is_warm, load_dataset
from disttrain.train.precision import Precision, build_optimizer, global_batch, scaled_lr, warmup_lambda
from disttrain.train.trainer import Trainer

__all__ = ["build_optimizer", "build_trainer", "load_splits_local_rank0_first", "planned_steps"]
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def planned_steps(cfg: TrainSpec, batches_per_epoch: int) -> int:
    """Optimizer steps the run will take (an epoch's short last group is one step)."""
    per_epoch = -(-batches_per_epoch // cfg.grad_accum)
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps else total


def load_splits_local_rank0_first(rt: Runtime, load: Callable[..., Splits],
                                  download: bool) -> Splits:
    """Load the data on every rank; a download happens on each node's local rank 0 alone,
    before the other ranks load.

    Had every rank loaded at once, the others (which must not all download into the same
    folder) would look for the files while local rank 0 is still fetching them, and fail.
    So local rank 0 loads first (downloading if needed: once per node, since nodes need
    not share a filesystem; on a shared one the downloads are atomic renames of the same
    bytes), all ranks meet at a barrier, and then the others load what is now on disk.

    Args:
        rt: this process's runtime (its barrier is a no-op at world size 1).
        load: the loader, called as `load(download=...)`.
        download: whether a missing dataset may be downloaded.

    Returns:
        This rank's splits.

    Example:
        >>> splits = load_splits_local_rank0_first(rt, partial(load_dataset, "mnist"), True)
    """
    if not download or rt.world_size == 1:
        return load(download=download)
    if rt.local_rank == 0:
        try:
            return load(download=True)
        finally:
            # NOTE: meet the barrier even when the download failed, so the other ranks
            # fail at once on the missing files instead of waiting out the timeout.
            rt.barrier()
    rt.barrier()
    return load(download=False)


def build_trainer(spec: JobSpec, rt: Runtime, writer: RunWriter | None = None) -> Trainer:
    """Everything the built-in job needs, on this rank's device.

    Args:
        spec: the job (its `train` section and `example`).
        rt: this process's runtime.
        writer: rank 0's run-directory writer (default: created here on rank 0).

    Raises:
        StrategyError, PrecisionError: a combination this runtime cannot run.
    """
    cfg = spec.train
    if spec.script:
        raise ValueError("build_trainer runs the built-in examples; scripts run via torchrun")
    strategy, note = resolve_strategy(cfg.strategy, rt)
    notes = [DP_ADVICE] if cfg.strategy == "dp" else []
    notes += [note] if note else []
    if strategy == "fsdp" and cfg.comm_hook == "powersgd":
        raise StrategyError("train.comm_hook: powersgd is a DDP comm hook and FSDP has none; "
                            "use --strategy ddp, or --comm-hook bf16/fp16 with fsdp")
    precision = Precision.create(cfg.precision, rt.device, sharded=strategy == "fsdp")
    example = spec.workload
    load = functools.partial(load_dataset, example, data_dir=cfg.data_dir,
                             num_samples=cfg.num_samples, input_size=cfg.input_size)
    splits = load_splits_local_rank0_first(rt, load, download=cfg.download)
    # Same seed on every rank: identical initial weights (DDP would broadcast anyway).
    seed_everything(cfg.seed)
    model = build_model(example, cfg.input_size or splits.input_size, cfg.hidden_size,
                        splits.num_classes)
    if cfg.grad_ckpt:
        notes.append(f"activation checkpointing: {enable_grad_ckpt(model)}")
    opts = WrapOptions(fsdp_sharding=cfg.fsdp_sharding,
                       fsdp_reduce_dtype=REDUCE_DTYPES.get(cfg.comm_hook))
    fsdp_bytes = _fsdp_bytes(model, strategy, cfg.comm_hook)  # before sharding: full sizes
    model = wrap(model, strategy, rt, opts)
    loader = ShardedLoader(splits.train_x, splits.train_y, cfg.batch_size, rt.rank,
                           rt.world_size, shuffle=True, seed=cfg.seed, num_workers=cfg.num_workers)
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
        writer = RunWriter(spec.run_dir)
        if not (spec.run_dir / "job.yaml").exists():
            writer.write_spec(spec.to_yaml())
    info = {
        "name": spec.name, "workload": example, "strategy": cfg.strategy,
        "strategy_effective": strategy, "backend": rt.backend, "device": str(rt.device),
        "world_size": rt.world_size, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
        "global_batch": global_batch(cfg.batch_size, rt.world_size, cfg.grad_accum),
        "lr_base": cfg.lr, "lr_effective": lr, "lr_scaling": cfg.lr_scaling,
        "warmup_steps": cfg.warmup_steps, "precision": cfg.precision,
        "comm_hook": cfg.comm_hook if strategy in ("ddp", "fsdp") else "none",
        "optimizer": _describe(optimizer), "torch_version": torch.__version__,
        "train_samples": len(splits.train_x), "test_samples": len(splits.test_x),
        "data_preloaded": is_warm(splits),
        "allreduce_bytes_per_step": fsdp_bytes,
        "run_dir": spec.run_dir, "notes": notes,
    }
    for line in notes:
        rt.print0(line)
    return Trainer(rt=rt, cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=loader, test_x=splits.test_x, test_y=splits.test_y,
                   precision=precision, writer=writer, info=info, comm=comm)


def _describe(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__
    return f"{name} (fused)" if optimizer.defaults.get("fused") else name


def _fsdp_bytes(model: torch.nn.Module, strategy: str, comm_hook: str) -> int:
    """FSDP's reduce-scatter bytes per step, computed (FSDP has no comm hook to count
    with); DDP's are measured by its comm hook and put in the summary by the Trainer."""
    if strategy != "fsdp":
        return 0
    from disttrain.distributed.fsdp import reduced_grad_bytes

    return reduced_grad_bytes(model, REDUCE_DTYPES.get(comm_hook))

