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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from disttrain.plan.slice import SliceOverhead, slice_request
from disttrain.plan.trace import Knobs, first_batch, trace_memory
from disttrain.train.task import TrainTask

MAX_TRIES = 12   # traces at most; each costs about one fake step of the model
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
        if changed in seen:   # cpu-offload brings fsdp: {fsdp, cpu-offload} is {cpu-offload}
            continue
        seen.add(changed)
        flags: list[str] = []
        for k in combo:
            for pair in _pairs(k.flags(changed)):
                redundant = pair[0] == "--strategy" and knobs.strategy == "fsdp"
                if not redundant and not _has(flags, pair):
                    flags += pair
        yield changed, flags


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
    for changed, flags in itertools.islice(combinations(knobs), MAX_TRIES):
        if time.monotonic() > deadline:
            break
        if changed.batch_size not in batches:
            batches[changed.batch_size] = first_batch(task, changed.batch_size, changed.world_size)
        peak = trace_memory(task, changed, batches[changed.batch_size])
        need = slice_request(peak.peak_bytes, procs, changed.world_size, overhead).gpumem_mib
        tried.append((flags, need))
        if gpumem is not None and need <= gpumem:
            return Suggestion(flags, need, peak.peak_bytes, tried)
    return Suggestion(None, None, None, tried)
