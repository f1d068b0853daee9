"""The memory plan of a job: what one rank holds, the slice to ask for, and whether it fits.

    from disttrain.plan import plan_job, plan_task
    plan = plan_job(spec)                          # a JobSpec (task or built-in example)
    plan = plan_task(task, knobs, gpumem=12000)    # any TrainTask (recipes, tests)
    plan.gpumem_mib, plan.fits, plan.as_dict()

The tensor peak comes from a trace on fake tensors (`plan/trace.py`), the slice from it by
`plan/slice.py`, the knobs that would make a job fit from `plan/fit.py`. Host memory per
pod and /dev/shm are estimated beside it (`host_needs`). docs/memory.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from disttrain.plan.slice import MIB, SliceOverhead, SliceRequest, procs_per_gpu, slice_request
from disttrain.plan.trace import Knobs, TensorPeak, first_batch
from disttrain.plan.tracing import trace_memory
from disttrain.train.task import TrainTask

# Host memory a rank's process needs besides model copies: the Python interpreter, torch
# and the CUDA libraries it maps. An allowance, not a measurement (this machine has the CPU
# wheel); a DataLoader worker is a forked copy that shares most of it.
PROCESS_BASE_MIB = 1024
WORKER_BASE_MIB = 512


@dataclass
class MemoryPlan:
    """A job's plan (one rank: every rank holds the same under DDP; rank 0, the busiest,
    under FSDP, whose first ranks take the padded shards)."""

    knobs: Knobs
    tensors: TensorPeak
    request: SliceRequest
    gpumem: int | None                 # the slice asked for (None: none set or auto)
    host: dict[str, Any] = field(default_factory=dict)
    suggestion: Any = None             # plan/fit.py's Suggestion when it does not fit
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.tensors.peak_bytes

    @property
    def gpumem_mib(self) -> int:
        return self.request.gpumem_mib

    @property
    def fits(self) -> bool | None:
        return None if self.gpumem is None else self.gpumem_mib <= self.gpumem

    @property
    def headroom_mib(self) -> int | None:
        return None if self.gpumem is None else self.gpumem - self.gpumem_mib

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes, "gpumem_mib": self.gpumem_mib, "fits": self.fits,
            "gpumem": self.gpumem, "headroom_mib": self.headroom_mib,
            "peak_phase": self.tensors.phase,
            "per_rank": {k: v for k, v in self.tensors.largest.items()},
            "stages": self.tensors.stages,   # pp: each stage's figures (per_rank: the busiest)
            "at_peak": self.tensors.at_peak,
            "largest_modules": [{"module": m, "activation_bytes": b}
                                for m, b in self.tensors.modules],
            "slice": self.request.as_dict(), "host": self.host,
            "knobs": {k: v for k, v in vars(self.knobs).items()},
            "suggestion": self.suggestion.as_dict() if self.suggestion is not None else None,
            "notes": self.notes,
        }


def knobs_of(spec: Any) -> Knobs:
    """The plan's knobs from a JobSpec: the strategy as it will really run at the job's
    world size (`resolve_strategy`'s rule: ddp/fsdp at world size 1 run bare)."""
    from disttrain.launch.argv import resolve_nproc

    gpus = spec.cluster.gpus
    nproc = resolve_nproc(spec, gpus=gpus if gpus >= 1 else 0)
    world = spec.launch.nnodes * nproc
    cfg = spec.train
    strategy = cfg.strategy
    if strategy in ("ddp", "fsdp") and world == 1:
        strategy = "none"
    if strategy == "dp":
        strategy = "none"   # one process driving the GPUs: each GPU holds a full replica
    par = spec.parallelism
    tp = pp = 1
    if par.model_parallel:   # the degrees as the ranks resolve them (a silently dropped
        from disttrain.spec.parallelism import resolve_degrees  # degree would plan another job)

        degrees = resolve_degrees(par, world)
        tp, pp = degrees.tp, degrees.pp
    return Knobs(strategy=strategy, world_size=world, local_world_size=nproc,
                 precision=cfg.precision, grad_ckpt=cfg.grad_ckpt, batch_size=cfg.batch_size,
                 grad_accum=cfg.grad_accum, optimizer=cfg.optimizer,
                 fsdp_sharding=cfg.fsdp_sharding,
                 cpu_offload=getattr(cfg, "cpu_offload", False) and strategy == "fsdp",
                 tp=tp, pp=pp, pp_schedule=par.pp_schedule, microbatches=par.microbatches)


def task_of(spec: Any) -> TrainTask:
    """The job's TrainTask through the run's own path (`train.build.task_for`)."""
    from disttrain.train import build

    if spec.script:
        from disttrain.errors import SpecError

        raise SpecError("a script's model is not known to disttrain, so it cannot be "
                        "planned: plan a --task (docs/your-model.md), or set cluster.gpumem "
                        "yourself")
    params = inspect.signature(build.task_for).parameters
    if len(params) >= 2:   # task_for(spec, rt) -> (task, facts)
        from disttrain.plan.trace import fake_runtime

        found = build.task_for(spec, fake_runtime(Knobs()))
    else:
        found = build.task_for(spec)
    return found[0] if isinstance(found, tuple) else found


def gpumem_of(spec: Any) -> int | None:
    value = spec.cluster.gpumem
    return value if isinstance(value, int) else None


def plan_job(spec: Any, search: bool = True) -> MemoryPlan:
    """The memory plan of `spec`'s job (its task or built-in example, its train and launch
    settings, its cluster's gpus and gpumem). `search`: when it does not fit, look for
    the knobs that would (plan/fit.py)."""
    knobs = knobs_of(spec)
    gpus = max(1, spec.cluster.gpus)
    return plan_task(task_of(spec), knobs, gpumem=gpumem_of(spec),
                     procs=procs_per_gpu(knobs.local_world_size, gpus),
                     overhead=SliceOverhead.from_spec(getattr(spec.cluster, "gpumem_overhead", None)),
                     num_workers=spec.train.num_workers, shm=spec.cluster.shm,
                     memory_limit=spec.cluster.memory.limit, search=search)


def plan_task(task: TrainTask, knobs: Knobs, gpumem: int | None = None, procs: int = 1,
              overhead: SliceOverhead | None = None, num_workers: int = 0,
              shm: str | None = None, memory_limit: str | None = None,
              search: bool = True, batch: Any = None) -> MemoryPlan:
    """The memory plan of `task` trained with `knobs` (the library entry: recipes call it).

    Args:
        task: what to train.
        knobs: the settings (strategy as it runs, world size, precision ...).
        gpumem: the slice asked for, MiB per GPU (None: no verdict).
        procs: ranks sharing each GPU.
        overhead: the slice constants (plan/slice.py).
        num_workers, shm, memory_limit: the host side (DataLoader workers, the pod's
            /dev/shm and memory limit).
        search: when it does not fit, look for the knobs that would.
        batch: one real batch of the per-rank shape (default: read from the task's data).
    """
    overhead = overhead or SliceOverhead()
    if batch is None:
        batch = first_batch(task, knobs.batch_size, knobs.world_size)
    tensors = trace_memory(task, knobs, batch)
    request = slice_request(tensors.peak_bytes, procs, knobs.world_size, overhead)
    plan = MemoryPlan(knobs=knobs, tensors=tensors, request=request, gpumem=gpumem,
                      host=host_needs(tensors, knobs, procs, num_workers, shm, memory_limit))
    plan.notes.append("traced on the CPU: CUDA kernels (SDPA backend, cuDNN workspaces) and "
                      "CUDA autocast op lists can differ; the allocator factor covers rounding")
    if knobs.cpu_offload:
        plan.notes.append("CPU offload: the rank's shards, gradients and optimizer state are "
                          "counted in host memory, not in the slice (host.offload_mib)")
    plan.notes.extend(parallel_notes(knobs, tensors))
    if knobs.strategy == "ddp" and not knobs.model_parallel:
        plan.notes.append("DDP traced as its bare module with gradients kept between steps "
                          "(gradient_as_bucket_view: the buckets are the gradients)")
    if search and plan.fits is False:
        from disttrain.plan.fit import search_fit

        plan.suggestion = search_fit(task, knobs, gpumem, procs, overhead)
    return plan


def host_needs(tensors: TensorPeak, knobs: Knobs, procs: int, num_workers: int,
               shm: str | None, memory_limit: str | None) -> dict[str, Any]:
    """Host memory per pod: each local rank's process and a full copy of its model while
    it is built (weights are made on the CPU, then moved), what CPU offload keeps there for
    the whole run (the rank's shards, gradients and optimizer state), its DataLoader
    workers; and the /dev/shm its workers pass batches through, against the pod's limits."""
    from disttrain.spec.fields import parse_quantity

    # the run builds the whole model on every rank, then shards or splits it
    whole = (knobs.world_size if knobs.strategy == "fsdp" and not knobs.model_parallel
             else knobs.tp * knobs.pp)
    model_mib = tensors.largest["parameters"] * whole / MIB
    offload_mib = tensors.host_bytes / MIB
    per_rank = PROCESS_BASE_MIB + model_mib + offload_mib + num_workers * WORKER_BASE_MIB
    need = int(per_rank * knobs.local_world_size)
    out: dict[str, Any] = {"memory_mib": need, "per_rank_mib": int(per_rank)}
    if offload_mib:
        out["offload_mib"] = round(offload_mib, 1)
    limit = float(parse_quantity(memory_limit)) if memory_limit else None
    if limit is not None:
        out["memory_limit_mib"] = int(limit / MIB)
        out["memory_fits"] = need <= limit / MIB
    if num_workers:
        batch_mib = tensors.at_peak["activations"] / MIB   # an upper bound of a batch's bytes
        shm_need = int(knobs.local_world_size * num_workers * 2 * max(batch_mib, 1))
        out["shm_mib"] = shm_need
        shm_bytes = float(parse_quantity(shm)) if shm else None
        if shm_bytes is not None:
            out["shm_fits"] = shm_need <= shm_bytes / MIB
    return out


def parallel_notes(knobs: Knobs, tensors: TensorPeak) -> list[str]:
    """What a tp or pp plan traced, and what it leaves out (docs/memory.md)."""
    if knobs.tp > 1:
        return [f"tp={knobs.tp}: traced on the run's own tp plan over a fake mesh: the "
                f"plan's layers hold 1/{knobs.tp} of their weights, gradients, optimizer "
                f"state and activations, the rest (embeddings, norms, head) whole; every tp "
                f"rank holds the same"]
    if knobs.pp > 1:
        per = ", ".join(f"stage {s['stage']} {s['peak_bytes'] / MIB:,.1f} MiB"
                        for s in tensors.stages)
        return [f"pp={knobs.pp}: each stage traced as the run splits it (balanced_cuts, "
                f"torch's pipeline frontend) under the {knobs.pp_schedule} schedule with "
                f"{knobs.microbatches} micro-batches; per stage: {per}; the busiest is the "
                f"peak; not traced: the tied-weight all-reduce and data parallel's gradient "
                f"average on top (in place)"]
    return []
