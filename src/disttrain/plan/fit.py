"""What would make a job fit its slice: the cheapest combination of knobs, as flags.

    s = search_fit(task, knobs, gpumem=12000, procs=1, overhead=SliceOverhead())
    s.flags        # ["--precision", "bf16", "--grad-ckpt"]   (None: nothing tried fits)

Each knob has a cost (what the job gives up for the memory): bf16 autocast is nearly free
and usually faster; FSDP over the job's own ranks adds an all-gather per unit; activation
checkpointing recomputes the forward (~1/3 more compute); a smaller per-rank batch with
more accumulation keeps the global batch (and the LR scaling) but runs more, smaller
steps; CPU offload (FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in
host memory, the optimizer stepping on the CPU) moves every step's state over PCIe; SGD
instead of Adam changes the training itself, so it is tried last. Combinations are traced
in order of total cost and the first that fits is the answer.

When none of them fits, a model-parallel degree is tried (issue 26 item 5): `--tp N` or
`--pp N`, smallest N first (tp before pp at the same N: pp adds the pipeline's bubble),
alone and then with bf16; N divides the world size, tp divides every head count and has a
plan (`tensor_parallel`), pp is at most the blocks (`pipeline.balanced_cuts`); what the
degree cannot run with is changed (`--strategy ddp` where this version composes nothing
else) or the degree skipped (pp with grad-ckpt or fp16, CPU offload).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from disttrain.plan.slice import SliceOverhead, slice_request
from disttrain.plan.trace import Knobs, build_fake_model, first_batch
from disttrain.plan.tracing import trace_memory
from disttrain.train.task import TrainTask

MAX_TRIES = 12   # traces at most; each costs about one fake step of the model
DEGREE_TRIES = 6  # then tp/pp degrees, at most this many traces (a pp trace is one per stage)
# ... and at most this long: a billion-parameter model takes tens of seconds per trace,
# and a search that outlasts the user's patience answers nothing (the tried ones are listed)
SEARCH_BUDGET_S = 180.0


@dataclass(frozen=True)
class Knob:
    name: str
    cost: int
    applies: Any            # (Knobs) -> bool
    change: Any             # (Knobs) -> Knobs
    flags: Any              # (Knobs) -> list[str], from the changed knobs


KNOBS = (
    Knob("bf16", 1, lambda k: k.precision == "fp32",
         lambda k: k.replace(precision="bf16"), lambda k: ["--precision", "bf16"]),
    Knob("fsdp", 2, lambda k: k.strategy in ("ddp", "none") and k.world_size > 1,
         lambda k: k.replace(strategy="fsdp"), lambda k: ["--strategy", "fsdp"]),
    Knob("grad-ckpt", 3, lambda k: not k.grad_ckpt,
         lambda k: k.replace(grad_ckpt=True), lambda k: ["--grad-ckpt"]),
    Knob("half-batch", 4, lambda k: k.batch_size >= 2,
         lambda k: k.replace(batch_size=k.batch_size // 2, grad_accum=k.grad_accum * 2),
         lambda k: ["--batch-size", str(k.batch_size), "--grad-accum", str(k.grad_accum)]),
    # needs FSDP: on a ddp job it brings `--strategy fsdp` with it (`combinations` drops the
    # repeated flag when the fsdp knob is in the same combination)
    Knob("cpu-offload", 5, lambda k: not k.cpu_offload and (
        k.strategy == "fsdp" or (k.strategy in ("ddp", "none") and k.world_size > 1)),
         lambda k: k.replace(strategy="fsdp", cpu_offload=True),
         lambda k: ["--strategy", "fsdp", "--cpu-offload"]),
    Knob("sgd", 6, lambda k: k.optimizer == "adam",
         lambda k: k.replace(optimizer="sgd"), lambda k: ["--optimizer", "sgd"]),
)


@dataclass
class Suggestion:
    """The cheapest combination that fits, or None when no combination tried does."""

    flags: list[str] | None
    gpumem_mib: int | None      # what the suggested job needs
    peak_bytes: int | None
    tried: list[tuple[list[str], int]]    # (flags, gpumem_mib) of every combination traced

    def as_dict(self) -> dict[str, Any]:
        return {"flags": self.flags, "gpumem_mib": self.gpumem_mib, "peak_bytes": self.peak_bytes,
                "tried": [{"flags": f, "gpumem_mib": g} for f, g in self.tried]}


def combinations(knobs: Knobs) -> Iterator[tuple[Knobs, list[str]]]:
    """Every combination of the knobs that apply, cheapest first (by summed cost, then size)."""
    usable = [k for k in KNOBS if k.applies(knobs)]
    combos = [c for n in range(1, len(usable) + 1) for c in itertools.combinations(usable, n)]
    combos.sort(key=lambda c: (sum(k.cost for k in c), len(c)))
    seen: set[Knobs] = set()
    for combo in combos:
        changed = knobs
        for k in combo:
            changed = k.change(changed)
        if changed in seen or not runnable(changed):   # cpu-offload brings fsdp: {fsdp,
            continue                                     # cpu-offload} is {cpu-offload}
        seen.add(changed)
        flags: list[str] = []
        for k in combo:
            for pair in _pairs(k.flags(changed)):
                redundant = pair[0] == "--strategy" and knobs.strategy == "fsdp"
                if not redundant and not _has(flags, pair):
                    flags += pair
        yield changed, flags


def runnable(knobs: Knobs) -> bool:
    """Whether the run takes these knobs together (a tp/pp job: `check_supported`, and what
    `ModelParallel.setup` refuses), so that no suggestion is one the run would refuse."""
    if not knobs.model_parallel:
        return True
    from disttrain.errors import SpecError
    from disttrain.spec.parallelism import Degrees, check_supported

    dp = knobs.world_size // (knobs.tp * knobs.pp)
    try:
        check_supported(Degrees(pp=knobs.pp, dp_replicate=1, dp_shard=dp, tp=knobs.tp),
                        knobs.strategy)
    except SpecError:
        return False
    if knobs.cpu_offload:     # not wired into FSDP2 x TP, nor pp
        return False
    return knobs.pp == 1 or not (knobs.grad_ckpt or knobs.precision == "fp16")


def _pairs(flags: list[str]) -> list[list[str]]:
    """A knob's flags as [flag] or [flag, value] groups."""
    out: list[list[str]] = []
    for f in flags:
        if f.startswith("--") or not out:
            out.append([f])
        else:
            out[-1].append(f)
    return out


def _has(flags: list[str], pair: list[str]) -> bool:
    return any(flags[i:i + len(pair)] == pair for i in range(len(flags)))


def search_fit(task: TrainTask, knobs: Knobs, gpumem: int | None, procs: int,
               overhead: SliceOverhead) -> Suggestion:
    """Trace the combinations cheapest first; the first whose slice fits `gpumem` wins."""
    tried: list[tuple[list[str], int]] = []
    if gpumem is None or slice_request(0, procs, knobs.world_size, overhead).gpumem_mib > gpumem:
        return Suggestion(None, None, None, tried)   # the contexts alone overflow it: no knob helps
    batches: dict[int, Any] = {}
    deadline = time.monotonic() + SEARCH_BUDGET_S
    # the cheap knobs first, then tp / pp degrees (a collective per layer, or a bubble)
    options = itertools.chain(itertools.islice(combinations(knobs), MAX_TRIES),
                              itertools.islice(degree_options(task, knobs), DEGREE_TRIES))
    for changed, flags in options:
        if time.monotonic() > deadline:
            break
        if changed.batch_size not in batches:
            batches[changed.batch_size] = first_batch(task, changed.batch_size, changed.world_size)
        peak = trace_memory(task, changed, batches[changed.batch_size])
        need = slice_request(peak.peak_bytes, procs, changed.world_size, overhead).gpumem_mib
        tried.append((flags, need))
        if need <= gpumem:
            return Suggestion(flags, need, peak.peak_bytes, tried)
    return Suggestion(None, None, None, tried)


def degree_options(task: TrainTask, knobs: Knobs) -> Iterator[tuple[Knobs, list[str]]]:
    """tp / pp degrees the job could run with, smallest first, alone then with bf16, as
    (knobs, flags). A job already split offers larger degrees of its own kind only."""
    kinds = ["tp", "pp"] if not knobs.model_parallel else (["tp"] if knobs.tp > 1 else ["pp"])
    current = max(knobs.tp, knobs.pp)
    model = build_fake_model(task)
    fits = {kind: [d for d in range(current + 1, knobs.world_size + 1)
                   if knobs.world_size % d == 0 and _splits(task, model, kind, d, knobs)]
            for kind in kinds}
    for degree in sorted({d for ds in fits.values() for d in ds}):
        for kind in kinds:
            if degree not in fits[kind]:
                continue
            changed = knobs.replace(**{kind: degree})
            flags = [f"--{kind}", str(degree)]
            dp = knobs.world_size // degree
            if (dp == 1 and knobs.strategy in ("fsdp", "dp")) or (
                    kind == "pp" and knobs.strategy == "fsdp"):
                changed, flags = changed.replace(strategy="ddp"), [*flags, "--strategy", "ddp"]
            if not runnable(changed):
                continue
            yield changed, flags
            if knobs.precision == "fp32":
                yield changed.replace(precision="bf16"), [*flags, "--precision", "bf16"]


def _splits(task: TrainTask, model: Any, kind: str, degree: int, knobs: Knobs) -> bool:
    """Whether the model and the job can run under `kind`=`degree` (the run's own checks)."""
    from disttrain.errors import DisttrainError

    if knobs.cpu_offload:   # not wired into FSDP2 x TP nor pp
        return False
    try:
        if kind == "tp":
            from disttrain.distributed.tensor_parallel import check_heads, tp_plan_for

            check_heads(model, degree)
            tp_plan_for(model, task.tp_plan)
            return True
        from disttrain.distributed.pipeline import balanced_cuts

        balanced_cuts(model, task.fsdp_block, degree)
    except DisttrainError:
        return False
    return (task.loss_fn is not None and not knobs.grad_ckpt and knobs.precision != "fp16"
            and knobs.batch_size % knobs.microbatches == 0)
