"""Signatures of a HAMi vGPU slice at its limit: the slice full, the card full, a slice too
small to start in (issue 22; docs/memory.md).

The patterns are HAMi-core's own format strings (Project-HAMi/HAMi-core at 8f3a89c), as its
log macros print them (src/include/log_utils.h: `[HAMI-core ERROR (pid:%d thread=%ld
%s:%d)]: ` before an error, `[HAMI-core Warn(%d:%ld:%s:%d)]: ` before a warning, shown at
the default LIBCUDA_LOG_LEVEL 2):

- src/allocator/allocator.c `oom_check`: `Device %d OOM %lu / %lu` (the allocation, with
  every process of the container on that device, above the slice's limit), after which
  the allocation returns CUDA_ERROR_OUT_OF_MEMORY and torch raises its usual
  `torch.OutOfMemoryError: CUDA out of memory`; before HAMi-core PR #56 (issue #55) the
  code was -1, which torch prints as `CUDA error: unrecognized error code`;
- src/allocator/allocator.c `add_chunk`: `cuMemoryAllocate failed res=%d` when the driver
  itself refuses; res=2 is CUDA_ERROR_OUT_OF_MEMORY: the physical card is full (the slices
  placed on it add up to more than it has, or a process outside HAMi uses it);
- src/cuda/memory.c `cuMemGetInfo_v2`: `limit < usage; usage=%ld, limit=%ld` and
  CUDA_ERROR_INVALID_VALUE (torch: `CUDA error: invalid argument`) when the container
  already uses more than its slice, which at a process's first memory query means the
  slice is smaller than one CUDA context (HAMi#1370: <= 345 MiB).

A torch OOM, or an `invalid argument` at the first query, in a log that shows HAMi-core
at work (any `[HAMI-core` line) or read inside a container with HAMi's limit variables
(CUDA_DEVICE_MEMORY_LIMIT*) is the slice's, not the card's: `refine_for_hami`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from disttrain.diagnose.log_signature import LIKELY, ROOT, Signature, sig

_UNRECOGNIZED = r"CUDA error: unrecognized error code"
_PLAN_FIX = (
    "The job needs more than its HAMi slice: every process of the container on that GPU "
    "counts, each with its CUDA context. `disttrain plan -f job.yaml --gpumem N` shows what "
    "a rank holds and the cheapest flags that fit (--precision bf16, --grad-ckpt, --strategy "
    "fsdp, a smaller --batch-size with more --grad-accum); or ask for a larger slice: "
    "cluster.gpumem (`gpumem: auto` requests the plan's figure). docs/memory.md.")

HAMI_CAUSES: dict[str, tuple[str, str]] = {
    "gpu_slice_oom": ("the HAMi vGPU slice is full{detail}", _PLAN_FIX),
    "gpu_physical_oom": (
        "the physical GPU is full: HAMi-core's allocation was refused by the driver "
        "(res=2, CUDA_ERROR_OUT_OF_MEMORY) although the slice had room",
        "The slices HAMi placed on this card add up to more than the card has, or a process "
        "outside HAMi's accounting uses it (`nvidia-smi` on the node shows every process). "
        "Lower cluster.gpumem so the slices fit the card (`disttrain plan` gives the job's "
        "real need), keep other pods off the card (gpu_policy spread, gpu_uuid_exclude), "
        "or ask for a whole GPU (gpumem unset)."),
    "gpu_slice_too_small": (
        "the HAMi slice is smaller than one CUDA context{detail}",
        "A process cannot even start in this slice: its CUDA context alone (300-500 MiB) is "
        "above the limit, so HAMi-core answers the first memory query with "
        "CUDA_ERROR_INVALID_VALUE ('CUDA error: invalid argument'; HAMi#1370: <= 345 MiB "
        "fails). Ask for at least 512 MiB per process on the GPU, or `gpumem: auto` "
        "(`disttrain plan` computes it); `disttrain k8s render` refuses such a slice."),
}

HAMI_RULES: tuple[Signature, ...] = (
    sig("gpu_slice_oom", ROOT, r"\bDevice (?P<dev>\d+) OOM (?P<used>\d+) / (?P<limit>\d+)",
        title="the HAMi vGPU slice is full: device {dev} needed {used}, the slice is {limit}"),
    sig("gpu_physical_oom", ROOT, r"cuMemoryAllocate failed res=2\b"),
    sig("gpu_slice_too_small", ROOT,
        r"limit < usage; usage=(?P<used>\d+), limit=(?P<limit>\d+)",
        title="the HAMi slice is smaller than one CUDA context: {used} in use at the first "
              "memory query, the slice is {limit}"),
    sig("gpu_slice_oom", LIKELY, _UNRECOGNIZED,
        title="an allocation over the HAMi slice, as an HAMi-core older than PR #56 reports "
              "it ('CUDA error: unrecognized error code' instead of out of memory)"),
)

_HAMI_MARK = "[HAMI-core"
_INVALID_ARGUMENT = "CUDA error: invalid argument"


def under_hami(texts: list[str], environ: Mapping[str, str] | None = None) -> bool:
    """The log shows HAMi-core, or the doctor runs in a container HAMi limits."""
    env = os.environ if environ is None else environ
    if any(k == "CUDA_DEVICE_MEMORY_LIMIT" or k.startswith("CUDA_DEVICE_MEMORY_LIMIT_")
           for k in env):
        return True
    return any(_HAMI_MARK in t for t in texts)


def refine_for_hami(winner: Any, hits: list[Any], texts: list[str],
                    environ: Mapping[str, str] | None = None) -> None:
    """Under HAMi a torch OOM is the slice's (gpu_slice_oom), and `CUDA error: invalid
    argument` the slice too small to start in (gpu_slice_too_small); changed in place.
    HAMi-core's own line carries a pid, not a rank: the rank is the torch OOM's."""
    hami = under_hami(texts, environ)
    if winner.sig is not None and winner.sig.pattern.pattern == _UNRECOGNIZED and not hami:
        winner.cause, winner.sig = "unknown", None   # not HAMi's -1: another cause
        return
    if winner.cause in ("gpu_slice_oom", "gpu_physical_oom") and winner.rank is None:
        winner.rank = next((h.rank for h in sorted(hits, key=lambda h: h.line)
                            if h.cause == "cuda_oom" and h.rank is not None), None)
    if winner.cause not in ("cuda_oom", "user_code_error", "unknown") or not hami:
        return
    line = texts[winner.line] if 0 <= winner.line < len(texts) else ""
    if winner.cause == "cuda_oom":
        winner.cause, winner.sig = "gpu_slice_oom", None
    elif _INVALID_ARGUMENT in line or any(_INVALID_ARGUMENT in t for t in texts):
        winner.cause, winner.sig = "gpu_slice_too_small", None
