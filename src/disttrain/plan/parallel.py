"""The memory plan of a tp or pp job: what each rank holds once the model is split.

    peak = trace_parallel(task, knobs, batch)    # knobs.tp > 1 or knobs.pp > 1

Both are traced on the real split, not a formula (issue 26 item 5; docs/memory.md):
- tp: the model is parallelized by the run's own plan (`tensor_parallel.tp_plan_for`,
  `apply_tp`) over the "tp" dimension of a DeviceMesh on a fake process group of the
  job's world size (built outside the fake mode: a mesh reads its rank list with
  `tolist()`, which a fake tensor cannot answer), then two steps of rank 0 are traced as
  for DDP/FSDP. Each tp rank holds the same share (the heads divide evenly), so rank 0 is
  every rank. With `--strategy fsdp` and ranks left for dp_shard, FSDP2 shards the tp
  model over them as the run does (`composed.fully_shard_tp`).
- pp: the model is split by torch's own frontend (`pipelining.pipeline`, the cuts of
  `pipeline.balanced_cuts`, as `ModelParallel.setup` does), and every stage is built
  with `pipelining.build_stage` and driven by the run's schedule (GPipe / 1F1B) for two
  optimizer steps, one stage at a time, under the tracker. The fake process group's
  send/recv do nothing, so each stage's receive buffers hold no data, only their size,
  which is what memory needs. The busiest stage is the plan's `peak_bytes`; every stage's
  figures are in `TensorPeak.stages`.

torch's MemTracker refuses a root module's second forward in one tracked region
("multiple iterative calls"), and a pipeline stage runs once per micro-batch: `repeatable`
restarts the module's statistics instead (the global peak, which the plan reads, is kept).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from disttrain.errors import SpecError
from disttrain.plan.trace import (
    Knobs,
    TensorPeak,
    _PhasePeaks,
    build_fake_model,
    fake_batch,
    fake_world,
    lean,
    materialize,
    traced_steps,
)
from disttrain.train.task import TaskError, TrainTask

__all__ = ["fake_mesh", "repeatable", "stage_tracker", "trace_parallel"]


def trace_parallel(task: TrainTask, knobs: Knobs, batch: Any) -> TensorPeak:
    """The busiest rank's traced tensor memory under `knobs`' tp or pp degree.

    Raises:
        SpecError: tp and pp together (not run by this version), a micro-batch count that
            does not divide the batch.
        StrategyError: the model does not split (heads, blocks, no tp plan).
        TaskError: a pp task without a loss_fn or (input, target) batches.
    """
    if knobs.tp > 1 and knobs.pp > 1:
        raise SpecError(f"parallelism: tp={knobs.tp} x pp={knobs.pp} is not run by this version, "
                        f"so it is not planned either; use one of them")
    return _trace_tp(task, knobs, batch) if knobs.tp > 1 else _trace_pp(task, knobs, batch)


def fake_mesh(knobs: Knobs) -> Any:
    """The job's DeviceMesh (pp, dp_replicate, dp_shard, tp) over the active fake process
    group; call it inside `fake_world` and outside the FakeTensorMode."""
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.spec.parallelism import DEGREE_NAMES

    dp = knobs.world_size // (knobs.tp * knobs.pp)
    if dp < 1 or dp * knobs.tp * knobs.pp != knobs.world_size:
        raise SpecError(f"parallelism: tp={knobs.tp} x pp={knobs.pp} does not divide the world "
                        f"size {knobs.world_size}")
    return init_device_mesh("cpu", (knobs.pp, 1, dp, knobs.tp), mesh_dim_names=DEGREE_NAMES)


def _trace_tp(task: TrainTask, knobs: Knobs, batch: Any) -> TensorPeak:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from disttrain.distributed.activation_ckpt import enable_grad_ckpt
    from disttrain.distributed.tensor_parallel import apply_tp, check_heads, tp_plan_for

    with fake_world(knobs.world_size):
        mesh = fake_mesh(knobs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = materialize(build_fake_model(task))
            if knobs.grad_ckpt:   # before the split, as train/build.py
                enable_grad_ckpt(model)
            check_heads(model, knobs.tp)
            apply_tp(model, mesh["tp"], tp_plan_for(model, task.tp_plan))
            sharded = knobs.strategy == "fsdp" and mesh["dp_shard"].size() > 1
            if sharded:
                from disttrain.distributed.composed import fully_shard_tp

                block = task.fsdp_block
                units = block if isinstance(block, tuple) else ((block,) if block else None)
                fully_shard_tp(model, mesh["dp_shard"], units, gloo=False)
            # the parameters are DTensors: one untracked step first caches their sharding
            # propagation (trace._warm_sharding_cache); the Trainer frees gradients (not DDP)
            return traced_steps(task, knobs, model, fake_batch(batch, mode), fsdp=sharded,
                                warm=True, keep_grads=False)


def _trace_pp(task: TrainTask, knobs: Knobs, batch: Any) -> TensorPeak:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed import pipelining

    from disttrain.distributed.pipeline import balanced_cuts

    if knobs.pp_schedule not in ("gpipe", "1f1b"):
        # a rank of interleaved 1F1B runs two stages under one schedule, which picks its
        # stages by the rank it is in the group: the fake world here is always rank 0
        raise SpecError(f"parallelism.pp_schedule: the memory plan traces gpipe and 1f1b, not "
                        f"{knobs.pp_schedule} yet; plan the job with --pp-schedule 1f1b (the "
                        f"same parameters and optimizer state per rank, fewer micro-batches "
                        f"in flight) and add headroom, or pass --no-plan to render/apply")
    if task.loss_fn is None:
        raise TaskError("pipeline parallel runs the loss on the last stage as loss_fn(output, "
                        "target); the task has only a step_fn: give it a loss_fn")
    # what ModelParallel.setup refuses under pp is refused here too, not traced without it
    if knobs.grad_ckpt:
        raise SpecError("train.grad_ckpt: the pipeline's stages are traced from the plain "
                        "model; drop --grad-ckpt with --pp")
    if knobs.precision == "fp16":
        raise SpecError("train.precision: fp16's loss scaler is not wired into the pipeline "
                        "schedule; use --precision bf16 or fp32 with --pp")
    if knobs.microbatches < 1 or knobs.batch_size % knobs.microbatches:
        raise SpecError(f"parallelism.microbatches: {knobs.microbatches} does not divide "
                        f"train.batch_size {knobs.batch_size}")
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise TaskError("pipeline parallel needs (input, target) batches")
    rows = knobs.batch_size // knobs.microbatches
    stages: list[TensorPeak] = []
    with fake_world(knobs.world_size), warnings.catch_warnings():
        # torch.export's own deprecation notices (pytree LeafSpec, a fake tensor's
        # data_ptr): about torch's internals, not the job; the run prints them too
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        group = fake_mesh(knobs)["pp"].get_group()
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = materialize(build_fake_model(task))
            cuts = balanced_cuts(model, task.fsdp_block, knobs.pp)
            x, y = fake_batch(tuple(batch), mode)
            # traced with fake CPU inputs: export bakes the device of tensors the forward
            # makes (chargpt's positions) into the graph, so meta would not do
            pipe = pipelining.pipeline(model, mb_args=(x[:rows],), split_spec={
                c: pipelining.SplitPoint.BEGINNING for c in cuts})
            for index in range(knobs.pp):
                stages.append(_trace_stage(task, knobs, pipe, index, group, x, y))
    busiest = max(range(len(stages)), key=lambda i: stages[i].peak_bytes)
    out = stages[busiest]
    out.stages = [{"stage": i, "peak_bytes": s.peak_bytes, "phase": s.phase, **s.largest}
                  for i, s in enumerate(stages)]
    out.phase = f"stage {busiest}, {out.phase}"
    return out


def _trace_stage(task: TrainTask, knobs: Knobs, pipe: Any, index: int, group: Any,
                 x: torch.Tensor, y: torch.Tensor) -> TensorPeak:
    """Two optimizer steps of stage `index` as `PipelinedModel` builds and runs it."""
    from torch.distributed import pipelining

    from disttrain.distributed.pipeline import SCHEDULES, _used_params
    from disttrain.train.optim import build_optimizer
    from disttrain.train.precision import Precision

    module = pipe.get_stage_module(index)
    stage = pipelining.build_stage(module, index, pipe.info(), torch.device("cpu"), group)
    m = knobs.microbatches
    loss_fn = task.loss_fn
    assert loss_fn is not None

    def staged_loss(output: Any, target: Any) -> torch.Tensor:   # as ModelParallel.setup
        return loss_fn(output, target) / m

    schedule = getattr(pipelining, SCHEDULES[knobs.pp_schedule])(
        stage, m, loss_fn=staged_loss, scale_grads=False)
    used = _used_params(module)
    params = [p for n, p in module.named_parameters() if n in used and p.requires_grad]
    optimizer = (task.optimizer(params, 1e-3) if task.optimizer is not None
                 else build_optimizer(knobs.optimizer, params, 1e-3))
    precision = Precision.create(knobs.precision, torch.device("cpu"), sharded=False)
    tracker = stage_tracker()
    tracker.track_external(module, optimizer, x, y)
    phases = _PhasePeaks(tracker)
    last = index == knobs.pp - 1
    with tracker:
        for step in (1, 2):
            tracker.reset_mod_stats()
            with precision.autocast():
                if index == 0:
                    schedule.step(x, target=y if last else None, losses=[])
                elif last:
                    schedule.step(target=y, losses=[])
                else:
                    schedule.step()
            phases.end(f"step {step} schedule (forward and backward)")
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            phases.end(f"step {step} optimizer")
    return phases.result([])


def repeatable(tracker_class: type) -> type:
    """`tracker_class` (a MemTracker) that accepts its root module's forward more than once
    in one region: a pipeline stage runs once per micro-batch, and torch raises
    "multiple iterative calls" at the second (its per-module statistics are dropped and
    begun again; the global peak is not touched)."""

    class Repeatable(tracker_class):  # type: ignore[misc, valid-type]
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    Repeatable.__name__ = f"Repeatable{tracker_class.__name__}"
    return Repeatable


def stage_tracker() -> Any:
    """The tracker for a pipeline stage: frozen-aware, peak only, repeatable; the same for
    the plan and for measuring a real stage (tests/plan, benchmarks/plan_parallel.py)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from disttrain.train.frozen_tracking import frozen_aware

    return repeatable(lean(frozen_aware(MemTracker)))()
