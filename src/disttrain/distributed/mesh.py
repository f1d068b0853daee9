"""One DeviceMesh for the whole job, built from the spec's `parallelism` degrees.

    degrees = resolve_degrees(spec.parallelism, rt.world_size)
    mesh = build_mesh(degrees, rt)          # dims ("pp", "dp_replicate", "dp_shard", "tp")
    tp_mesh = mesh["tp"]                    # what tensor parallel shards over
    dp_rank, dp_size = data_rank(mesh)      # which slice of the data this rank reads

Every dimension is kept, degree 1 included, so code can always index `mesh["tp"]`
(torchtitan drops degree-1 dimensions; keeping them costs one sub-group per rank and
saves every caller a branch). `init_device_mesh` creates the sub-groups from the
default process group (docs: pytorch.org/tutorials/recipes/distributed_device_mesh.html).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.distributed.runtime import Runtime
from disttrain.spec.parallelism import DEGREE_NAMES, Degrees

__all__ = ["build_mesh", "data_rank"]


def build_mesh(degrees: Degrees, rt: Runtime) -> DeviceMesh:
    """The job's mesh over `rt`'s process group, one named dimension per degree.

    Raises:
        RuntimeError: no process group (call `disttrain.distributed.runtime.setup` first),
            or the degrees do not multiply to the world size (`resolve_degrees` checks it).
    """
    if not rt.distributed:
        raise RuntimeError("build_mesh needs a process group: call disttrain.distributed.runtime.setup()")
    shape = degrees.shape()
    size = 1
    for d in shape:
        size *= d
    if size != rt.world_size:
        raise RuntimeError(f"mesh {degrees.describe()} has {size} ranks, the world {rt.world_size}")
    return init_device_mesh(rt.device.type, shape, mesh_dim_names=DEGREE_NAMES)


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's data shard: ranks that differ only in tp or pp read
    the same batches (a tp group computes one model replica, a pipeline feeds its first
    stage)."""
    shards = mesh.size(DEGREE_NAMES.index("dp_shard"))
    index = mesh.get_local_rank("dp_replicate") * shards + mesh.get_local_rank("dp_shard")
    return index, mesh.size(DEGREE_NAMES.index("dp_replicate")) * shards
