"""One rank's training step traced on fake tensors: the tensor memory it would hold.

    peak = trace_data_parallel(task, knobs, batch)   # TensorPeak: per category, peak, phase, modules

The model is built on the meta device and materialised under `FakeTensorMode` (storages
with sizes and no bytes), wrapped by the same code the run uses (`strategies.wrap`: FSDP2
over a fake process group of the real world size; activation checkpointing through
`enable_grad_ckpt`; the precision's autocast; the run's optimizer), and fed one batch of
the real per-rank shape for two optimizer steps under torch's memory tracker
(`torch.distributed._tools.mem_tracker.MemTracker`, `FSDPMemTracker` for FSDP), as
torchtitan's `scripts/estimate/estimation.py` does. Two steps because the first has no
optimizer state yet (docs/memory.md).

A tp or pp job (`Knobs.tp`, `Knobs.pp`) is traced on its real split by `plan/parallel.py`:
the tp plan over a fake mesh, or every pipeline stage under the run's schedule.

DDP's reducer cannot run on fake tensors (it reads the parameters' bytes to check them
across ranks), so a DDP job is traced as its bare module with gradients kept between steps,
which is what DDP with `gradient_as_bucket_view` holds: the buckets are the gradients.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.train.memory import OFFLOADED, on_host, peak_only
from disttrain.train.task import TaskError, TrainTask

# The tracker's categories (MemTracker and FSDPMemTracker names) -> the plan's.
CATEGORY = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Buffer": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients",
    # FSDP's all-gathered parameters and not yet reduce-scattered gradients live for one
    # unit's forward or backward: temporaries, not the rank's share of the model
    "Unsharded Param": "temporaries", "Unsharded Grad": "temporaries",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations", "Other": "activations",
    "Temp": "temporaries", "All Gather": "temporaries", "Reduce Scatter": "temporaries",
}
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
PHASES = ("forward", "backward", "optimizer")
TOP_MODULES = 5


@dataclass(frozen=True)
class Knobs:
    """What the trace depends on: the job's settings that change memory."""

    strategy: str = "ddp"          # as it will really run: none | dp | ddp | fsdp
    world_size: int = 1
    local_world_size: int = 1
    precision: str = "fp32"
    grad_ckpt: bool = False
    batch_size: int = 32
    grad_accum: int = 1
    optimizer: str = "adam"
    fsdp_sharding: str = "full"
    cpu_offload: bool = False      # FSDP2's CPUOffloadPolicy (fsdp only)
    # model parallel (issue 26): the degrees as the run resolves them (plan/parallel.py)
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 4

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def replace(self, **changes: Any) -> Knobs:
        return dataclasses.replace(self, **changes)


@dataclass
class TensorPeak:
    """One rank's traced tensor memory, in bytes."""

    peak_bytes: int
    phase: str                         # "step 2 backward"
    at_peak: dict[str, int]            # category -> bytes at the peak
    largest: dict[str, int]            # category -> the most it held at a phase's peak or end
    modules: list[tuple[str, int]] = field(default_factory=list)   # (name, activation bytes)
    phase_peaks: dict[str, int] = field(default_factory=dict)     # phase -> peak bytes
    phase_optimizer: dict[str, int] = field(default_factory=dict)  # phase -> optimizer bytes at its peak
    host_bytes: int = 0                # CPU offload: the most the rank kept in host memory
    stages: list[dict[str, Any]] = field(default_factory=list)    # pp: each stage's figures

    def as_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "phase": self.phase, "at_peak": self.at_peak,
                "largest": self.largest, "modules": [list(m) for m in self.modules],
                "phase_peaks": self.phase_peaks, "host_bytes": self.host_bytes,
                "stages": self.stages}


def fold(snapshot: dict[Any, int], skip: frozenset[str] = frozenset()) -> dict[str, int]:
    """A tracker snapshot of one device folded into the plan's categories (less the
    tracker categories in `skip`)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name in CATEGORY and name not in skip:
            out[CATEGORY[name]] += int(value)
    return out


def device_snapshot(tracker: Any, kind: str) -> dict[Any, int]:
    """The tracker's `kind` ("current"/"peak") snapshot of its one device ({} when empty)."""
    snaps = tracker.get_tracker_snapshot(kind)
    return next(iter(snaps.values()), {})


def total_of(snapshot: dict[Any, int]) -> int:
    return int(snapshot.get("Total", 0))


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks (this process is rank 0) for the
    duration; collectives return at once (`init_process_group("fake")`, torch's own
    `torch.testing._internal.distributed.fake_pg` store, as torchtitan's estimator uses)."""
    if dist.is_initialized():
        raise TaskError("a memory plan needs a process without a process group (it makes a "
                        "fake one of the job's world size); call it before init_process_group")
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_runtime(knobs: Knobs) -> Any:
    """A Runtime over the fake process group: rank 0 of the job's world, on the CPU."""
    from disttrain.distributed.env import DistEnv
    from disttrain.distributed.runtime import Runtime

    env = DistEnv(rank=0, world_size=knobs.world_size, local_rank=0,
                  local_world_size=min(knobs.local_world_size, knobs.world_size))
    return Runtime(env=env, backend="fake", device=torch.device("cpu"), timeout_s=60.0)


def first_batch(task: TrainTask, batch_size: int, world_size: int) -> Any:
    """One batch of rank 0's shape: the task's `example_batch(batch_size)` when it declares
    one, else read through the run's own loader (the task's dataset and collate_fn), with
    no worker processes."""
    if task.example_batch is not None:
        return _declared_batch(task, batch_size)
    from disttrain.distributed.env import DistEnv
    from disttrain.distributed.runtime import Runtime
    from disttrain.spec.job import TrainSpec
    from disttrain.train.build import make_loader

    rt = Runtime(env=DistEnv(rank=0, world_size=world_size), backend="fake",
                 device=torch.device("cpu"), timeout_s=60.0)
    cfg = TrainSpec(batch_size=batch_size, num_workers=0)
    loader = make_loader(task, cfg, rt)
    try:
        return next(iter(loader))
    except StopIteration:
        raise TaskError("the task's train_data gave no batch to plan with") from None
    except (OSError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TaskError(f"reading one batch of the task's train_data to plan with failed "
                        f"({type(exc).__name__}: {str(exc)[:200]}); where the data cannot be "
                        f"read here, give the TrainTask example_batch=fn(batch_size) -> one "
                        f"batch of that shape") from None


def _declared_batch(task: TrainTask, batch_size: int) -> Any:
    """The task's `example_batch(batch_size)`, checked to hold a tensor."""
    from torch.utils._pytree import tree_flatten

    try:
        batch = task.example_batch(batch_size)   # type: ignore[misc]
    except Exception as exc:   # the user's function: say which and why
        raise TaskError(f"the task's example_batch({batch_size}) raised "
                        f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if not any(isinstance(t, torch.Tensor) for t in tree_flatten(batch)[0]):
        raise TaskError(f"the task's example_batch({batch_size}) returned "
                        f"{type(batch).__name__} with no tensor in it: return one batch as "
                        f"the loader would (tensors of the per-rank batch's shape)")
    return batch


def fake_batch(batch: Any, mode: Any) -> Any:
    """The batch with every tensor a fake tensor of the same shape and dtype."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, mode.from_tensor, batch)


def build_fake_model(task: TrainTask) -> nn.Module:
    """The task's model on the meta device (no memory for weights); a ready-made module is
    copied to meta. Materialised on fake CPU storage by `trace_data_parallel`."""
    if isinstance(task.model, nn.Module):
        model = copy.deepcopy(task.model).to("meta")
    else:
        with torch.device("meta"):
            model = task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"the task's model factory returned {type(model).__name__}, "
                        f"not an nn.Module")
    return model


def materialize(model: nn.Module) -> nn.Module:
    """Give a meta model fake CPU storage in place (under the active FakeTensorMode).

    `Module.to_empty` would swap each parameter for a fake tensor subclass, which torch
    refuses once the fake mode holds a weak reference to the meta parameter; a new
    Parameter per entry does the same without the swap. Shared parameters stay shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    new = torch.empty_like(tensor, device="cpu")
                    if isinstance(tensor, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    made[id(tensor)] = new
                table[name] = made[id(tensor)]
    return model


def trace_data_parallel(task: TrainTask, knobs: Knobs, batch: Any) -> TensorPeak:
    """Trace two optimizer steps of rank 0 of a data-parallel job (ddp, fsdp, none) and
    return its tensor memory; `disttrain.plan.tracing.trace_memory` is the entry that also
    takes tp / pp jobs.

    Args:
        task: the job's TrainTask.
        knobs: the settings to trace with (strategy as it will run, world size ...).
        batch: one real batch of the per-rank shape (`first_batch`).

    Raises:
        TaskError: the model, batch or step cannot be traced (the message says why).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_world(knobs.world_size), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = materialize(build_fake_model(task))
        return _trace(task, knobs, model, fake_batch(batch, mode))


def _wrap(task: TrainTask, knobs: Knobs, model: nn.Module) -> nn.Module:
    """The run's own wrapping (`train/build.py`): checkpointing, then the strategy; DDP
    stays bare (see the module docstring)."""
    from disttrain.distributed.activation_ckpt import enable_grad_ckpt
    from disttrain.distributed.strategies import STRATEGIES, WrapOptions

    if knobs.grad_ckpt:
        enable_grad_ckpt(model)
    if knobs.strategy != "fsdp":
        return model
    blocks = task.fsdp_block if isinstance(task.fsdp_block, tuple) else (
        (task.fsdp_block,) if task.fsdp_block is not None else None)
    opts = WrapOptions(fsdp_sharding=knobs.fsdp_sharding, fsdp_unit_types=blocks,
                       fsdp_cpu_offload=knobs.cpu_offload)
    # `strategies.wrap` minus its `.to(device)`: the model is on the (fake) CPU already,
    # and moving fake parameters would swap them (see `materialize`).
    return STRATEGIES["fsdp"](model, fake_runtime(knobs), opts)


def _trace(task: TrainTask, knobs: Knobs, model: nn.Module, batch: Any) -> TensorPeak:
    model = _wrap(task, knobs, model)
    # Under DDP the gradients are its buckets' views and are zeroed in place; elsewhere
    # the Trainer frees them (set_to_none), as here.
    return traced_steps(task, knobs, model, batch, fsdp=knobs.strategy == "fsdp",
                        warm=knobs.strategy == "fsdp", keep_grads=knobs.strategy == "ddp")


def traced_steps(task: TrainTask, knobs: Knobs, model: nn.Module, batch: Any, *, fsdp: bool,
                 warm: bool, keep_grads: bool) -> TensorPeak:
    """Two optimizer steps of the (wrapped) `model` under the tracker, as the Trainer runs
    them. `fsdp`: FSDPMemTracker (its categories); `warm`: one untracked step first (DTensor
    parameters: see `_warm_sharding_cache`); `keep_grads`: zero gradients in place (DDP)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from disttrain.train.frozen_tracking import frozen_aware
    from disttrain.train.optim import build_optimizer
    from disttrain.train.precision import Precision
    from disttrain.train.steps import run_step

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]   # as train/build.py
    optimizer = (task.optimizer(trainable, 1e-3) if task.optimizer is not None
                 else build_optimizer(knobs.optimizer, trainable, 1e-3))
    precision = Precision.create(knobs.precision, torch.device("cpu"), sharded=fsdp)
    host = OFFLOADED if knobs.cpu_offload and fsdp else frozenset()
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker: Any = lean(FSDPMemTracker, host)(model, optimizer)
    else:
        # frozen parameters (a LoRA base) are held, never given a gradient: train/frozen_tracking.py
        tracker = lean(frozen_aware(MemTracker))()
    if warm:
        _warm_sharding_cache(task, model, optimizer, precision, batch)
    tracker.track_external(model, optimizer, *_tensors(batch))
    phases = _PhasePeaks(tracker, host)
    with tracker:
        for step in (1, 2):
            tracker.reset_mod_stats()   # the trackers refuse a second root forward otherwise
            with precision.autocast():
                loss, _ = run_step(task, model, batch)
            phases.end(f"step {step} forward")
            precision.backward(loss)
            del loss
            phases.end(f"step {step} backward")
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=not keep_grads)
            phases.end(f"step {step} optimizer")
        modules = _largest_modules(tracker)
    return phases.result(modules)


def _warm_sharding_cache(task: TrainTask, model: nn.Module, optimizer: Any, precision: Any,
                         batch: Any) -> None:
    """One untracked step, then the optimizer's state and the gradients dropped again.

    The optimizer updates FSDP's DTensor parameters; the first time DTensor meets an op on
    a shape it propagates the sharding by running the op on fake tensors, under the fake
    mode already active here, so the tracker would count those tensors (the first step of
    a real run propagates under a fake mode of its own, which the tracker skips). The
    propagation is cached per shape, so after this step the traced steps are the real ones.
    """
    from disttrain.train.steps import run_step

    with precision.autocast():
        loss, _ = run_step(task, model, batch)
    precision.backward(loss)
    del loss
    precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()


def lean(tracker_class: type, host: frozenset[str] = frozenset()) -> type:
    """The tracker without its per-module peaks, which the plan does not read, and with the
    device's peak when `host` names offloaded categories (`train.memory.peak_only`)."""
    return peak_only(tracker_class, host)


def _tensors(batch: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]


class _PhasePeaks:
    """The peak of each phase (forward, backward, optimizer of each step): the tracker
    keeps one running peak; it is read and restarted from the current memory at each
    phase's end (private fields of `_tools`, which has no public reset of the peak)."""

    def __init__(self, tracker: Any, host: frozenset[str] = frozenset()) -> None:
        self.tracker = tracker
        self.host = host              # tracker categories held in host memory (CPU offload)
        self.host_bytes = 0
        self.peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self.largest = dict.fromkeys(CATEGORIES, 0)

    def end(self, phase: str) -> None:
        peak = device_snapshot(self.tracker, "peak")
        self.peaks[phase] = (total_of(peak), fold(peak, self.host))
        current = device_snapshot(self.tracker, "current")
        for snap in (peak, current):
            self.host_bytes = max(self.host_bytes, on_host(snap, self.host))
            for name, value in fold(snap).items():
                self.largest[name] = max(self.largest[name], value)
        if hasattr(self.tracker, "_peak_mem") and current:
            dev = next(iter(self.tracker.get_tracker_snapshot("current")))
            total = total_of(current) - on_host(current, self.host)
            self.tracker._peak_mem[dev] = total
            self.tracker._peak_mem_snap[dev] = {**current, "Total": total}

    def result(self, modules: list[tuple[str, int]]) -> TensorPeak:
        phase, (peak, at_peak) = max(self.peaks.items(), key=lambda kv: kv[1][0])
        return TensorPeak(peak_bytes=peak, phase=phase, at_peak=at_peak, largest=self.largest,
                          modules=modules,
                          phase_peaks={p: v[0] for p, v in self.peaks.items()},
                          phase_optimizer={p: v[1]["optimizer"] for p, v in self.peaks.items()},
                          host_bytes=self.host_bytes)


def _largest_modules(tracker: Any) -> list[tuple[str, int]]:
    """The modules whose forward left the most activation memory alive (their output and
    what autograd saved for their backward), top `TOP_MODULES`, among the innermost of the
    outer three levels (a container is left out when one of its children is listed)."""
    from torch.distributed._tools.mem_tracker import _ModState

    names = {stats.mod_fqn for stats in tracker.memory_tracking.values()}
    found: list[tuple[str, int]] = []
    for stats in tracker.memory_tracking.values():
        name = stats.mod_fqn
        if name.count(".") > 3 or "." not in name:
            continue
        if any(other.startswith(name + ".") and other.count(".") <= 3 for other in names):
            continue
        pre = stats.snapshots.get(_ModState.PRE_FW) or _fsdp_state(stats, "AFT_PRE_FW")
        post = stats.snapshots.get(_ModState.POST_FW) or _fsdp_state(stats, "BEF_POST_FW")
        if not pre or not post:
            continue
        before = fold(next(iter(pre[-1].values()), {}))
        after = fold(next(iter(post[-1].values()), {}))
        grown = after["activations"] - before["activations"]
        if grown > 0:
            found.append((name.split(".", 1)[1], grown))
    found.sort(key=lambda m: -m[1])
    return found[:TOP_MODULES]


def _fsdp_state(stats: Any, name: str) -> list[Any]:
    """FSDPMemTracker's snapshots of an FSDP unit, by its own state names (after the
    all-gather of its pre-forward, before the reshard of its post-forward)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState

    return stats.snapshots.get(getattr(_FSDPModState, name, None)) or []
