"""From a traced tensor peak to the HAMi slice (`nvidia.com/gpumem`, MiB per GPU) to request.

    need = slice_request(peak_bytes, procs_per_gpu=1, world_size=2, overhead=SliceOverhead())
    need.gpumem_mib        # 2304: tensors x fragmentation + context + NCCL + cuBLAS, rounded up

HAMi charges a slice for everything every process of the container holds on that device:
the tensors, the caching allocator's slack around them, and each process's CUDA context
(HAMi-core adds `context_size` at `cuDevicePrimaryCtxRetain`, src/cuda/context.c). None
of that is a tensor, so each is a named constant with its source, overridable in the spec
(`cluster.gpumem_overhead`) and measured by `benchmarks/gpu_check.sh` on a GPU.
docs/memory.md explains each term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MIB = 2**20

# One CUDA context with lazy module loading (PyTorch's default since 1.13): 287 MB measured
# in pytorch#86509, ~300-400 MB in pytorch#107667 / #109888, 426 MiB with torch 2.10 + CUDA 13
# (unsloth-zoo#1053). The largest of these, rounded up.
CUDA_CONTEXT_MIB = 512
# The smallest slice in which a process can start at all: HAMi#1370 (K3s, HAMi 2.6.1) saw
# `CUDA error: invalid argument` at the first memory query with gpumem <= 345 MiB and a
# working process at 346 (HAMi-core's cuMemGetInfo_v2 answers CUDA_ERROR_INVALID_VALUE
# once usage exceeds the limit, src/cuda/memory.c). Below it a slice is always refused.
MIN_SLICE_MIB = 346
# NCCL's buffers per communicator: 544 MB for a 2-GPU group, 688 MB for more, on 4 x A100
# NVLink (NVIDIA/nccl#964, #986); they grow with channels. Only when the world is > 1.
NCCL_2GPU_MIB = 544
NCCL_MANY_MIB = 688
# cuBLAS workspaces come from the caching allocator: CUBLAS_WORKSPACE_CONFIG's default
# ":4096:8" is 8 x 4 MiB (torch docs, "Reproducibility"); the tracker does not see them.
CUBLAS_WORKSPACE_MIB = 32
# The caching allocator reserves more than the tensors it hands out: every block rounds up
# to 512 B (CUDACachingAllocator.cpp kMinBlockSize) and large blocks come from 2 MiB / 20 MiB
# segments; reserved / allocated of 1.1-1.3 is common (the PyTorch OOM message's "reserved
# but unallocated"). 1.2 until gpu_check.sh measures the image's own ratio.
FRAGMENTATION = 1.2
# The request is rounded up to a multiple of this (HAMi takes any integer; round numbers
# are easier to compare and leave a little headroom).
ROUND_MIB = 256


@dataclass(frozen=True)
class SliceOverhead:
    """The constants above, each overridable (`cluster.gpumem_overhead` in the spec)."""

    context_mib: int = CUDA_CONTEXT_MIB
    nccl_mib: int | None = None          # None: NCCL_2GPU_MIB or NCCL_MANY_MIB by world size
    cublas_mib: int = CUBLAS_WORKSPACE_MIB
    fragmentation: float = FRAGMENTATION
    round_mib: int = ROUND_MIB

    @classmethod
    def from_spec(cls, values: Any) -> SliceOverhead:
        """From the spec's `cluster.gpumem_overhead` (a model, a dict or None)."""
        if values is None:
            return cls()
        data = values.model_dump(exclude_none=True) if hasattr(values, "model_dump") else dict(values)
        return cls(**{k: v for k, v in data.items() if v is not None})

    def nccl_for(self, world_size: int) -> int:
        if world_size <= 1:
            return 0
        if self.nccl_mib is not None:
            return self.nccl_mib
        return NCCL_2GPU_MIB if world_size == 2 else NCCL_MANY_MIB


@dataclass
class SliceRequest:
    """The slice one GPU needs, term by term, in MiB."""

    tensors_mib: float           # the traced tensor peak of every process on the GPU
    allocator_mib: float         # fragmentation's share
    context_mib: float
    nccl_mib: float
    cublas_mib: float
    gpumem_mib: int              # the sum, rounded up
    procs_per_gpu: int
    terms: dict[str, str] = field(default_factory=dict)   # term -> where its constant is from

    def as_dict(self) -> dict[str, Any]:
        return {"tensors_mib": round(self.tensors_mib, 1),
                "allocator_mib": round(self.allocator_mib, 1),
                "context_mib": self.context_mib, "nccl_mib": self.nccl_mib,
                "cublas_mib": self.cublas_mib, "gpumem_mib": self.gpumem_mib,
                "procs_per_gpu": self.procs_per_gpu}


def slice_request(peak_bytes: int, procs_per_gpu: int, world_size: int,
                  overhead: SliceOverhead | None = None) -> SliceRequest:
    """The `gpumem` (MiB per GPU) for a rank whose tensors peak at `peak_bytes`, with
    `procs_per_gpu` such ranks sharing each GPU (HAMi sums every process of the container)."""
    o = overhead or SliceOverhead()
    n = max(1, procs_per_gpu)
    tensors = n * peak_bytes / MIB
    allocator = tensors * (o.fragmentation - 1.0)
    context, nccl, cublas = n * o.context_mib, n * o.nccl_for(world_size), n * o.cublas_mib
    total = tensors + allocator + context + nccl + cublas
    rounded = int(math.ceil(total / o.round_mib) * o.round_mib)
    return SliceRequest(tensors, allocator, context, nccl, cublas, max(rounded, MIN_SLICE_MIB), n)


def procs_per_gpu(nproc_per_node: int, gpus_per_pod: int) -> int:
    """Processes sharing each GPU of a pod: one per GPU when there are enough GPUs."""
    return max(1, math.ceil(nproc_per_node / max(1, gpus_per_pod)))


def too_small(gpumem_mib: int) -> str | None:
    """Why a slice cannot hold even one process (None when it can)."""
    if gpumem_mib < MIN_SLICE_MIB:
        return (f"cluster.gpumem {gpumem_mib} MiB is smaller than one CUDA context: a process "
                f"fails at its first memory query with 'CUDA error: invalid argument' "
                f"(HAMi#1370: <= 345 MiB fails); ask for at least {CUDA_CONTEXT_MIB} MiB, or "
                f"--gpumem auto")
    return None
