"""Assemble a Trainer from a JobSpec and a TrainTask: model, loaders, strategy, optimizer,
schedule, writer.

    trainer = build_trainer(spec, rt)              # the spec's task (built-in ones too)
    trainer = build_trainer(spec, rt, task)        # any TrainTask (what disttrain.fit does)
    task = task_for(spec)                          # only the task (reference + task_args)

Kept apart from the loop (torchtitan keeps config, parallelism and loop apart) so that
`Trainer` only stores already-built parts and tests can build one from pieces. The model
and data come from the task, built from the spec's reference and task_args by
`train.task.load_task` (the built-in jobs are tasks too: `disttrain.examples.digits:make_task`,
...; nothing here knows them); everything after that step is the same for any model.
Choices made here, each printed in the start banner and stored in summary.json (`RunInfo`):
- the loader: in-memory (input, target) tensors are gathered by index (`ShardedLoader`),
  any other map-style Dataset goes through a DataLoader (`DatasetLoader`), both in the
  same DistributedSampler order; an IterableDataset shards itself (`IterableLoader`);
- the strategy that really runs (`resolve_strategy`: ddp/fsdp at world size 1 and dp
  with < 2 GPUs run as none, without a wrapper);
- the comm hook (DDP) or gradient reduce dtype (FSDP), with bytes counted per step;
- the LR scaled with the global batch = batch x world size x grad_accum (linear scaling
  by default: a bigger batch takes fewer, larger steps; docs/strategies.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from disttrain.distributed.activation_ckpt import enable_grad_ckpt
from disttrain.distributed.comm_hooks import CommStats, register_comm_hook
from disttrain.distributed.fsdp import REDUCE_DTYPES
from disttrain.distributed.process import seed_everything
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import (
    WrapOptions,
    dp_gpu_count,
    resolve_strategy,
    wrap,
)
from disttrain.errors import SpecError
from disttrain.resilience.ranks import identify
from disttrain.rundir import RunWriter, open_writer
from disttrain.spec.job import JobSpec, TrainSpec
from disttrain.spec.rules import check_runnable
from disttrain.train.evaluate import Evaluator
from disttrain.train.iterable_loader import IterableLoader
from disttrain.train.loader import DatasetLoader, SampledLoader, ShardedLoader, seed_worker
from disttrain.train.model_parallel import ModelParallel
from disttrain.train.optim import build_optimizer, describe, global_batch, scaled_lr, warmup_lambda
from disttrain.train.precision import Precision
from disttrain.train.run_info import RunInfo
from disttrain.train.task import TaskError, TrainTask, load_task, task_warmed
from disttrain.train.trainer import Trainer

__all__ = ["build_trainer", "make_loader", "make_model", "planned_steps", "task_for"]
EVAL_BATCH = 1024   # held-out samples per forward (no gradients: larger than training's)


def planned_steps(cfg: TrainSpec, batches_per_epoch: int) -> int:
    """Optimizer steps the run will take (an epoch's short last group is one step)."""
    per_epoch = -(-batches_per_epoch // cfg.grad_accum)
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps else total


def task_for(spec: JobSpec) -> TrainTask:
    """The spec's task, built from its reference and `task_args` (`load_task`), the module
    looked for in the spec's task_dir, then the current folder."""
    if spec.script or not spec.task:
        raise SpecError("build_trainer trains a task; a script runs under torchrun "
                        "(`disttrain run SCRIPT`)")
    return load_task(spec.task, spec.task_args, search=[spec.task_dir or ".", "."])


def make_model(task: TrainTask, seed: int, rt: Runtime) -> nn.Module:
    """The task's model, the same on every rank: a factory is called right after seeding;
    a module given ready-made gets rank 0's weights (it was built before any seed)."""
    seed_everything(seed)
    model = task.model if isinstance(task.model, nn.Module) else task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"the task's model factory returned {type(model).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise TaskError(f"the model ({type(model).__name__}) has no trainable parameters")
    if isinstance(task.model, nn.Module) and rt.distributed and rt.world_size > 1:
        import torch.distributed as dist

        model = model.to(rt.device)
        with torch.no_grad():   # state_dict tensors share the parameters' storage
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
    return model


def make_loader(task: TrainTask, cfg: TrainSpec, rt: Runtime, shard: tuple[int, int] | None = None
                ) -> SampledLoader | IterableLoader:
    """This rank's training batches (see the module docstring for which loader and why);
    `shard` = (index, count) of its data slice when that is not (rank, world size): tp/pp."""
    data, collate = task.train_data, task.collate_fn
    rank, world = shard or (rt.rank, rt.world_size)
    pin = rt.device.type == "cuda"
    if isinstance(data, IterableDataset):
        return IterableLoader(data, cfg.batch_size, rt.device, rt.distributed and rt.world_size > 1,
                              collate_fn=collate, num_workers=cfg.num_workers, pin_memory=pin,
                              worker_init_fn=seed_worker)
    if isinstance(data, TensorDataset) and len(data.tensors) == 2 and collate is None:
        x, y = data.tensors
        return ShardedLoader(x, y, cfg.batch_size, rank, world, shuffle=True,
                             seed=cfg.seed, num_workers=cfg.num_workers)
    return DatasetLoader(data, cfg.batch_size, rank, world, seed=cfg.seed,
                         collate_fn=collate, num_workers=cfg.num_workers, pin_memory=pin,
                         worker_init_fn=seed_worker)


def build_trainer(spec: JobSpec, rt: Runtime, task: TrainTask | None = None,
                  writer: RunWriter | None = None) -> Trainer:
    """Everything a run needs, on this rank's device.

    Args:
        spec: the job (its `train` section; its `task` when `task` is None).
        rt: this process's runtime.
        task: what to train; default: the spec's task (`task_for`).
        writer: rank 0's run-directory writer (default: created here on rank 0).

    Raises:
        StrategyError, PrecisionError: a combination this runtime cannot run.
        TaskError: the task cannot be loaded or trained (named in the message).
    """
    cfg = spec.train
    # The same host rules `disttrain run` applied before launch, now with this rank's view.
    notes = check_runnable(spec, gpus=dp_gpu_count(rt), world_size=rt.world_size)
    strategy, note = resolve_strategy(cfg.strategy, rt)
    notes += [note] if note else []
    precision = Precision.create(cfg.precision, rt.device, sharded=strategy == "fsdp")
    # the data is the warm fork server's shared copy (launch/forkserver_preload.py)
    preloaded = task is None and task_warmed(spec.task, spec.task_args)
    if task is None:
        task = task_for(spec)
    model = make_model(task, cfg.seed, rt)
    if cfg.grad_ckpt:
        notes.append(f"activation checkpointing: {enable_grad_ckpt(model)}")
    if getattr(cfg, "sync_batchnorm", False) and strategy == "ddp":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        notes.append("sync_batchnorm: BatchNorm layers normalise with the global batch's statistics")
    blocks = task.fsdp_block if isinstance(task.fsdp_block, tuple) else (
        (task.fsdp_block,) if task.fsdp_block is not None else None)
    offload = getattr(cfg, "cpu_offload", False)
    if offload and strategy != "fsdp":
        notes.append(f"cpu_offload: not applied, strategy fsdp runs as {strategy} here "
                     f"(world size {rt.world_size})")
    opts = WrapOptions(fsdp_sharding=cfg.fsdp_sharding,
                       fsdp_reduce_dtype=REDUCE_DTYPES.get(cfg.comm_hook), fsdp_unit_types=blocks,
                       fsdp_cpu_offload=offload and strategy == "fsdp")
    parallel = None
    if spec.parallelism.model_parallel:  # tp / pp: a mesh instead of a DDP/FSDP wrapper
        parallel = ModelParallel.setup(spec, rt, task, model)
        model, strategy = parallel.model, parallel.kind
        fsdp_bytes = parallel.reduced_grad_bytes()   # the split model's, not the whole one's
        notes.append(parallel.describe())
    else:
        fsdp_bytes = _fsdp_bytes(model, strategy, cfg.comm_hook)  # before sharding: full sizes
    if parallel is not None:
        pass  # split in place on this rank's device: nothing to wrap
    elif task.load_weights is None:
        model = wrap(model, strategy, rt, opts)
    else:  # built on meta: the task reads the weights once and wraps where it must
        model = task.load_weights(model, rt, strategy, lambda m, **ddp: wrap(
            m, strategy, rt, dataclasses.replace(opts, extra={**opts.extra, **ddp})))
    loader = make_loader(task, cfg, rt, (parallel.dp_rank, parallel.dp_size) if parallel else None)
    if parallel is not None and parallel.pipe is not None and isinstance(loader, SampledLoader):
        loader.whole_batches = True
    data_ranks = parallel.dp_size if parallel is not None else rt.world_size
    comm: CommStats | None = None
    if strategy == "ddp":
        steps = planned_steps(cfg, len(loader)) if isinstance(loader, SampledLoader) else 1000
        comm = register_comm_hook(model, cfg.comm_hook, steps, poll=rt.backend == "gloo")
    elif cfg.comm_hook != "none" and strategy not in ("fsdp", "fsdp+tp"):
        notes.append(f"comm_hook {cfg.comm_hook}: only DDP communicates gradients; ignored "
                     f"with strategy {strategy}")
    lr = scaled_lr(cfg.lr, cfg.lr_scaling, cfg.batch_size, data_ranks, cfg.grad_accum)
    if cfg.warmup_steps:
        notes.append(f"lr warm-up: linear from {lr / cfg.warmup_steps:g} to {lr:g} over "
                     f"{cfg.warmup_steps} optimizer steps")
    # Frozen parameters (a LoRA base) are not the optimizer's: no state, no update.
    trainable = (parallel.parameters() if parallel is not None
                 else [p for p in model.parameters() if p.requires_grad])
    optimizer = (task.optimizer(trainable, lr) if task.optimizer is not None
                 else build_optimizer(cfg.optimizer, trainable, lr))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskError(f"the task's optimizer factory returned {type(optimizer).__name__}, "
                        f"not a torch.optim.Optimizer")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.warmup_steps))
    identify(spec.run_dir, spec.name, rt)  # process title + RUN_DIR/ranks.json, once per round
    if writer is None and rt.is_rank0:
        writer = open_writer(spec.run_dir, spec.to_yaml())
    info = RunInfo(
        name=spec.name, workload=task.name or "task", strategy=cfg.strategy,
        strategy_effective=strategy, backend=rt.backend, device=str(rt.device),
        world_size=rt.world_size, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
        global_batch=global_batch(cfg.batch_size, data_ranks, cfg.grad_accum),
        lr_base=cfg.lr, lr_effective=lr, lr_scaling=cfg.lr_scaling,
        warmup_steps=cfg.warmup_steps, precision=cfg.precision,
        comm_hook=cfg.comm_hook if strategy in ("ddp", "fsdp", "fsdp+tp") else "none",
        optimizer=describe(optimizer), torch_version=torch.__version__,
        train_samples=_length(task.train_data), test_samples=_length(task.eval_data),
        data_preloaded=preloaded,
        allreduce_bytes_per_step=fsdp_bytes, run_dir=spec.run_dir, notes=notes,
    )
    for line in notes:
        rt.print0(line)
    evaluator = (parallel.evaluator(task, rt, precision, max(EVAL_BATCH, cfg.batch_size),
                                    cfg.num_workers) if parallel is not None else
                 Evaluator(task, rt, precision, batch_size=max(EVAL_BATCH, cfg.batch_size),
                           lockstep=strategy == "fsdp", num_workers=cfg.num_workers))
    return Trainer(rt=rt, cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                   task=task, loader=loader, evaluator=evaluator, precision=precision,
                   writer=writer, info=info, comm=comm, parallel=parallel)


def _length(data: Any) -> int:
    """Samples in a map-style dataset; 0 for a stream (unknown) or none."""
    if data is None or isinstance(data, IterableDataset):
        return 0
    return len(data)


def _fsdp_bytes(model: torch.nn.Module, strategy: str, comm_hook: str) -> int:
    """FSDP's reduce-scatter bytes per step, computed (FSDP has no comm hook to count
    with); DDP's are measured by its comm hook and put in the summary by the Trainer."""
    if strategy != "fsdp":
        return 0
    from disttrain.distributed.fsdp import reduced_grad_bytes

    return reduced_grad_bytes(model, REDUCE_DTYPES.get(comm_hook))

