"""The plan as `disttrain plan` prints it, and the one-line verdicts render/apply print."""

from __future__ import annotations

from disttrain.plan.job import MemoryPlan
from disttrain.plan.slice import MIB


def mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if n < 10 * 2**30 else f"{n / 2**30:,.2f} GiB"


def gib(m: float) -> str:
    return f"{m / 1024:.1f} GiB"


def format_plan(plan: MemoryPlan) -> str:
    k, t, r = plan.knobs, plan.tensors, plan.request
    who = ("every rank holds the same" if k.strategy != "fsdp"
           else "rank 0, the busiest: FSDP's padded shards are on the first ranks")
    if k.model_parallel:
        who = layout_who(plan)
    lines = [f"memory plan: {layout(plan)} over {k.world_size} rank(s), {k.precision}, "
             f"batch {k.batch_size}/rank, {k.optimizer}"
             f"{', activation checkpointing' if k.grad_ckpt else ''}"
             f"{', CPU offload' if k.cpu_offload else ''} ({who})",
             "  per rank (the most each held at any point of two steps):"]
    for name in ("parameters", "gradients", "optimizer", "activations", "temporaries"):
        lines.append(f"    {name:<12} {mib(t.largest[name]):>14}   at the peak {mib(t.at_peak[name])}")
    for st in t.stages:
        lines.append(f"    stage {st['stage']}: parameters {mib(st['parameters'])}, optimizer "
                     f"{mib(st['optimizer'])}, activations {mib(st['activations'])}, peak "
                     f"{mib(st['peak_bytes'])}")
    lines.append(f"  tensor peak  {mib(t.peak_bytes)} in {t.phase}"
                 f"{' on the device' if k.cpu_offload else ''}")
    if k.cpu_offload:
        lines.append(f"  in host memory (CPU offload: shards, gradients, optimizer state): "
                     f"{mib(t.host_bytes)} per rank")
    if t.modules:
        mods = ", ".join(f"{m} {mib(b)}" for m, b in t.modules)
        lines.append(f"  largest modules (activations they keep): {mods}")
    lines.append(f"  slice per GPU: {r.procs_per_gpu} process(es) x (tensors + allocator "
                 f"{plan_fragmentation(plan)} + CUDA context + NCCL + cuBLAS) = "
                 f"{r.tensors_mib:,.0f} + {r.allocator_mib:,.0f} + {r.context_mib} + "
                 f"{r.nccl_mib} + {r.cublas_mib} MiB -> gpumem {r.gpumem_mib}")
    lines.append("  " + verdict(plan))
    host = plan.host
    if host:
        line = f"  host per pod: ~{host['memory_mib']:,} MiB"
        if "memory_fits" in host:
            line += (f" (limit {host['memory_limit_mib']:,} MiB: "
                     f"{'fits' if host['memory_fits'] else 'DOES NOT FIT'})")
        if "shm_mib" in host:
            line += f"; /dev/shm ~{host['shm_mib']:,} MiB"
            if "shm_fits" in host:
                line += " (fits cluster.shm)" if host["shm_fits"] else " (ABOVE cluster.shm)"
        lines.append(line)
    for note in plan.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def layout(plan: MemoryPlan) -> str:
    """`ddp`, `fsdp`, `tp=2`, `tp=2 x fsdp dp_shard=2`, `pp=2 (1f1b, 4 micro-batches)` ..."""
    k = plan.knobs
    if not k.model_parallel:
        return k.strategy
    dp = k.world_size // (k.tp * k.pp)
    on_top = f" x {k.strategy} dp_shard={dp}" if dp > 1 else ""
    if k.tp > 1:
        return f"tp={k.tp}{on_top}"
    return f"pp={k.pp} ({k.pp_schedule}, {k.microbatches} micro-batches){on_top}"


def layout_who(plan: MemoryPlan) -> str:
    k = plan.knobs
    if k.tp > 1:
        return "every tp rank holds the same: its shards of the tp plan's layers, the rest whole"
    busiest = max(plan.tensors.stages, key=lambda s: s["peak_bytes"])["stage"] if plan.tensors.stages else 0
    return f"the busiest stage, {busiest}: each stage below"


def plan_fragmentation(plan: MemoryPlan) -> str:
    r = plan.request
    factor = 1 + (r.allocator_mib / r.tensors_mib if r.tensors_mib else 0)
    return f"x{factor:.2f}"


def verdict(plan: MemoryPlan) -> str:
    """`fits with X MiB headroom` / `does not fit ...: pass FLAGS (N GiB) or --gpumem M`."""
    if plan.gpumem is None:
        return f"request: gpumem {plan.gpumem_mib} (no slice set: --gpumem {plan.gpumem_mib} or auto)"
    if plan.fits:
        return (f"fits: needs {plan.gpumem_mib} MiB per GPU, slice is {plan.gpumem} MiB "
                f"({plan.headroom_mib} MiB headroom)")
    return refusal(plan)


def refusal(plan: MemoryPlan) -> str:
    text = (f"needs {gib(plan.gpumem_mib)} per GPU ({plan.gpumem_mib} MiB), slice is "
            f"{plan.gpumem} MiB")
    s = plan.suggestion
    if s is not None and s.flags:
        return f"{text}: pass {' '.join(s.flags)} ({gib(s.gpumem_mib)}) or --gpumem {plan.gpumem_mib}"
    return f"{text}: pass --gpumem {plan.gpumem_mib}"
