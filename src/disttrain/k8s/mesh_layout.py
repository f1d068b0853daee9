"""How a job's parallelism mesh lands on pods x processes, checked and described at render.

    layout = mesh_layout(spec, nproc)     # None for plain data parallel
    layout.describe()   # "pp=2 x dp_replicate=1 x dp_shard=1 x tp=2 on 2 pods x 2 processes:
                        #  across pods: pp; within each pod: tp"

torchrun numbers the ranks pod by pod (a pod's processes hold a contiguous block of global
ranks), and the mesh's dimensions run outermost first `pp, dp_replicate, dp_shard, tp`
(spec/parallelism.py), so tp groups are runs of adjacent ranks and pp stages are the
largest blocks: tp lands within a pod when it divides the processes per pod, and pp spans
the pods. That is the split the communication wants: tp all-reduces activations twice per
block in the forward and twice in the backward, on the critical path of every layer, so it
needs the pod's GPU link (NVLink / PCIe P2P / shared memory); pp sends only one
activation (forward) and one gradient (backward) per micro-batch between adjacent stages,
which the network between pods carries well (reference: ../shared/reference/
cluster-fit-and-scale.md §4). A tp that does not divide the processes per pod would put
every tp all-reduce on the network, so it is refused here with the fix.

NCCL: no variable is set for the split. The transports NCCL picks are already the right
ones (P2P/SHM within a pod for tp, sockets or IB between pods for pp); what the split
changes is what the opt-in HAMi workarounds cost, and the renderer warns about that:
with `no-p2p`/`no-shm` (HAMi#1502) every tp all-reduce goes through host memory or
sockets, and without a memory-backed /dev/shm NCCL's SHM transport, which tp within a pod
uses when P2P is off, fails in `ncclShmOpen` (pytorch/tutorials#2475 gave its CI container
2 GB of /dev/shm for that segfault). The layout is written on the pods as the annotation
`disttrain.io/mesh`; the degrees themselves reach the ranks in job.yaml, which the
rendered command reads (`--spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from disttrain.errors import SpecError
from disttrain.spec.job import JobSpec
from disttrain.spec.parallelism import DEGREE_NAMES, Degrees, ParallelismSpec, resolve_degrees

__all__ = ["ANNOTATION_MESH", "MeshLayout", "mesh_layout", "place"]

ANNOTATION_MESH = "disttrain.io/mesh"
SLOW_TRANSPORT = ("no-p2p", "no-shm")  # HAMi workarounds that move intra-pod NCCL off P2P/SHM


@dataclass(frozen=True)
class MeshLayout:
    """The resolved degrees on `pods` pods of `nproc` processes, and which dimensions'
    groups span more than one pod."""

    degrees: Degrees
    pods: int
    nproc: int
    across_pods: tuple[str, ...]
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        used = [n for n in DEGREE_NAMES if getattr(self.degrees, n) > 1]
        across = [n for n in used if n in self.across_pods]
        within = [n for n in used if n not in self.across_pods]
        where = [f"across pods: {', '.join(across)}"] if across else []
        where += [f"within each pod: {', '.join(within)}"] if within else []
        return (f"{self.degrees.describe()} on {self.pods} pod{'s' * (self.pods > 1)} x "
                f"{self.nproc} process{'es' * (self.nproc > 1)}" + (f": {'; '.join(where)}" if where else ""))


def mesh_layout(spec: JobSpec, nproc: int) -> MeshLayout | None:
    """The layout of `spec`'s mesh with `nproc` processes per pod; None without a
    `parallelism` section (plain data parallel: nothing to place).

    Raises:
        SpecError: the degrees do not fit the world (`resolve_degrees`), or tp does not
            divide the processes per pod (one line with the reason and the fix).
    """
    if spec.script or spec.parallelism == ParallelismSpec():
        return None
    pods = spec.launch.nnodes
    if spec.cluster.elastic_nodes:  # the world changes with the pods: the ranks resolve it
        _check_tp_in_pod(spec.parallelism.tp, nproc)
        return None
    layout = place(resolve_degrees(spec.parallelism, pods * nproc), pods, nproc)
    layout.warnings.extend(_transport_warnings(spec, layout.degrees))
    return layout


def place(degrees: Degrees, pods: int, nproc: int) -> MeshLayout:
    """`degrees` on `pods` pods of `nproc` processes (torchrun's pod-by-pod rank order).

    Raises:
        SpecError: tp does not divide `nproc` (a tp group would span pods).
    """
    _check_tp_in_pod(degrees.tp, nproc)
    return MeshLayout(degrees, pods, nproc, _across_pods(degrees, nproc))


def _check_tp_in_pod(tp: int, nproc: int) -> None:
    if tp > 1 and nproc % tp:
        raise SpecError(
            f"parallelism.tp: {tp} does not divide launch.nproc_per_node {nproc}: a "
            f"tensor-parallel group must sit within one pod (its all-reduces run in every "
            f"layer, forward and backward, and want the pod's GPU link, not the network); use "
            f"a tp that divides {nproc} (pp across pods for the rest), or --nproc-per-node "
            f"and --gpus a multiple of {tp}")


def _across_pods(degrees: Degrees, nproc: int) -> tuple[str, ...]:
    """The dimensions with a group whose ranks sit on more than one pod (rank // nproc)."""
    shape = degrees.shape()
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    across = []
    for dim, name in enumerate(DEGREE_NAMES):
        if shape[dim] == 1:
            continue
        others = [range(s) if i != dim else range(1) for i, s in enumerate(shape)]
        for start in product(*others):
            base = sum(c * st for c, st in zip(start, strides, strict=True))
            pods = {(base + k * strides[dim]) // nproc for k in range(shape[dim])}
            if len(pods) > 1:
                across.append(name)
                break
    return tuple(across)


def _transport_warnings(spec: JobSpec, degrees: Degrees) -> list[str]:
    c, out = spec.cluster, []
    if degrees.tp <= 1:
        return out
    slow = [w for w in c.vgpu_workarounds if w in SLOW_TRANSPORT]
    if c.nccl_preset == "no-p2p" and "no-p2p" not in slow:
        slow.append("no-p2p")
    if slow:
        out.append(f"parallelism.tp: {degrees.tp} with {', '.join(slow)} (cluster.vgpu_workarounds"
                   f"/nccl_preset): every tensor-parallel all-reduce, two per block forward and "
                   f"two backward, then goes through host memory or sockets; on this cluster "
                   f"prefer --pp (one activation per micro-batch between stages) or fsdp")
    if not c.shm:
        out.append(f"cluster.shm: tp={degrees.tp} runs its all-reduces inside the pod, where "
                   f"NCCL's shared-memory transport needs a memory-backed /dev/shm (without "
                   f"it NCCL can fail in ncclShmOpen); set --shm 2Gi")
    return out
