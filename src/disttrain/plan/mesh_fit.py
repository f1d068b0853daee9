"""Does the task's model fit the parallelism degrees? Checked before any process starts.

    check_mesh_fits(spec)          # SpecError / StrategyError, one line each
    builds_model(spec)             # whether it will build the model (tp or pp above 1)

The degree product against the world size is the spec's own check (`resolve_degrees`,
when `JobSpec` is validated); what needs the model is checked here, on the meta device (no
memory for weights, nothing downloaded beyond what the task's factory reads itself):
- tp must divide every head count the model states (each rank holds whole heads:
  `tensor_parallel.check_heads`), and a built-in plan must fit it or the task give one;
- pp (times 2 under interleaved 1F1B: two stages per rank) must not exceed the number of
  blocks the model is cut at (`pipeline.balanced_cuts`).
Inside the ranks `ModelParallel.setup` applies the same checks again; here they cost one
model build in the CLI instead of a process group, a launch and N tracebacks.
"""

from __future__ import annotations

from typing import Any

from disttrain.errors import DisttrainError, StrategyError
from disttrain.spec.parallelism import Degrees, ParallelismSpec, check_supported, resolve_degrees

__all__ = ["MODEL_CHECK_IMPORTS", "builds_model", "check_mesh_fits", "degrees_before_launch"]

# What building the meta model and checking it imports beyond torch: the meta model's
# initialisers run torch._refs under `_disable_dynamo`, which imports torch._dynamo. The
# ranks of such a job import the same, so `disttrain run` has its warm server share them
# (`disttrain.launch.forkserver.prewarm_workers`, share_imports).
MODEL_CHECK_IMPORTS = ("torch._dynamo", "disttrain.distributed.pipeline",
                       "disttrain.distributed.tensor_parallel")


def degrees_before_launch(spec: Any) -> Degrees | None:
    """The resolved degrees when the spec fixes the world size (launch.nnodes x an integer
    nproc_per_node, not elastic); else None (the ranks resolve them)."""
    nproc = spec.launch.nproc_per_node
    if not isinstance(nproc, int) or getattr(spec.cluster, "elastic_nodes", None):
        return None
    return resolve_degrees(spec.parallelism, spec.launch.nnodes * nproc)


def check_mesh_fits(spec: Any, nproc: int | None = None) -> None:
    """Refuse degrees the task's model cannot be split into (a built-in job with tp or pp).

    Args:
        spec: the job (a JobSpec).
        nproc: processes per node for an `auto` nproc_per_node, as the launcher will
            resolve it (`disttrain run`: this machine's GPUs or 2; k8s: the pod's GPUs);
            None: a -1 degree is then taken as 1 and not checked (the ranks check it).

    Raises:
        SpecError: the degrees do not multiply to the world size.
        StrategyError: tp does not divide the heads, no tp plan fits, pp exceeds the blocks.
        TaskError: the task cannot be built.
    """
    if not _may_build(spec):
        return
    tp, pp = _wanted(spec, nproc)
    if tp == 1 and pp == 1:
        return
    from disttrain.distributed.pipeline import STAGES_PER_RANK, balanced_cuts, block_names
    from disttrain.distributed.tensor_parallel import check_heads, tp_plan_for
    from disttrain.plan.job import task_of
    from disttrain.plan.trace import build_fake_model

    task = task_of(spec)
    model = build_fake_model(task)
    if tp > 1:
        check_heads(model, tp)
        tp_plan_for(model, task.tp_plan)
    if pp > 1:   # interleaved 1F1B: two stages per rank, as the ranks will cut it
        schedule = spec.parallelism.pp_schedule
        per_rank = STAGES_PER_RANK.get(schedule, 1)
        try:
            balanced_cuts(model, task.fsdp_block, pp * per_rank)
        except StrategyError:
            if per_rank == 1:
                raise
            blocks = len(block_names(model, task.fsdp_block))
            fix = (f" or --pp {blocks // per_rank}" if blocks // per_rank > 1
                   else f" (interleaved needs at least {2 * per_rank} blocks)")
            raise StrategyError(f"parallelism.pp_schedule: {schedule} cuts the model into "
                                f"{per_rank} stages per rank, {pp * per_rank} for --pp {pp}, "
                                f"but it has {blocks} blocks; use --pp-schedule 1f1b{fix}") from None


def builds_model(spec: Any, nproc: int | None = None) -> bool:
    """Whether `check_mesh_fits(spec, nproc)` builds the task's model: tp or pp above 1.
    False for degrees it refuses before that (its own call says why)."""
    if not _may_build(spec):
        return False
    try:
        tp, pp = _wanted(spec, nproc)
    except DisttrainError:
        return False
    return tp > 1 or pp > 1


def _may_build(spec: Any) -> bool:
    return bool(spec.task) and not spec.script and spec.parallelism != ParallelismSpec()


def _wanted(spec: Any, nproc: int | None) -> tuple[int, int]:
    """(tp, pp) as the ranks will resolve them; the product and what this version composes
    are checked here too when the world size is known (`auto` processes: the caller's)."""
    degrees = degrees_before_launch(spec)
    if degrees is None and nproc is not None and not getattr(spec.cluster, "elastic_nodes", None):
        degrees = resolve_degrees(spec.parallelism, spec.launch.nnodes * nproc)
    if degrees is not None:
        check_supported(degrees, spec.train.strategy)
        return degrees.tp, degrees.pp
    p = spec.parallelism
    return max(p.tp, 1), max(p.pp, 1)
