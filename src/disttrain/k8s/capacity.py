"""Does the gang fit now? Free HAMi vGPU slices per node, read from HAMi's own annotations.

    fit = gang_fit(spec, nodes, pods)   # the API's Node and Pod objects (all namespaces)
    fit.fits, fit.message               # 'needs 2 pods × 2 slices of 12000 MiB; free now: ...'

HAMi keeps its books in annotations (Project-HAMi/HAMi, read at v2.10.0 `4707fb0`):

- each GPU node's device plugin registers its GPUs in `hami.io/node-nvidia-register`
  (pkg/device/nvidia/device.go RegisterAnnos). Since v2.8.0 (#1499) it is JSON,
  `[{"id": "GPU-…", "count": 10, "devmem": 24576, "devcore": 100, "type": "NVIDIA-…",
  "health": true, "numa": 0, "index": 0, "mode": "hami-core"}, ...]`
  (pkg/device/devices.go MarshalNodeDevices; `omitempty` drops false/0 fields); before it
  was `id,count,devmem,devcore,type,numa,health[,index,mode]:` per GPU, each ended by ":"
  (DecodeNodeDevices, still accepted by HAMi for 7 or 9 fields).
- the scheduler writes each bound pod's devices in `hami.io/vgpu-devices-allocated`:
  per container `uuid,type,usedmem,usedcores:` per GPU, containers ended by ";"
  (EncodePodSingleDevice / EncodeContainerDevices; the same format in v2.6 and v2.10).

A GPU holds a slice when it has a free slot (`count` is deviceSplitCount), `devmem - used
>= gpumem` and `devcore - used >= gpucores`; gpucores 100 wants an unused card, and a
card whose cores are all taken takes no gpucores-0 slice (nvidia/device.go Fit). A pod
with `nvidia.com/gpu: N` needs N such GPUs on one node. Pods are placed one at a time on
the node with the most free slices, as a greedy estimate of what hami-scheduler can do.
Node selector, use/nouse-gputype, cordoned and NotReady nodes are honoured; quotas,
NUMA, UUID filters and MIG are not (the check says "now", not "ever").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disttrain.k8s.gang import pod_count
from disttrain.spec.job import JobSpec

REGISTER = "hami.io/node-nvidia-register"
ALLOCATED = "hami.io/vgpu-devices-allocated"
_DONE = ("Succeeded", "Failed")


@dataclass
class Gpu:
    """One registered GPU and what the pods bound to it use."""

    uuid: str
    node: str
    count: int  # slots (deviceSplitCount)
    devmem: int  # MiB
    devcore: int
    type: str
    health: bool
    used: int = 0
    usedmem: int = 0
    usedcores: int = 0

    def takes(self, mem: int, cores: int) -> bool:
        """Can this GPU hold one more slice of `mem` MiB and `cores` % now?"""
        if not self.health or self.used >= self.count:
            return False
        if self.devmem - self.usedmem < mem or self.devcore - self.usedcores < cores:
            return False
        if cores >= 100 and self.used > 0:
            return False
        return not (cores == 0 and self.devcore and self.usedcores >= self.devcore)

    def take(self, mem: int, cores: int) -> None:
        self.used, self.usedmem, self.usedcores = (self.used + 1, self.usedmem + mem,
                                                    self.usedcores + cores)


@dataclass
class Fit:
    fits: bool
    message: str
    free: dict[str, int] = field(default_factory=dict)  # node -> slices of this size


def parse_node_devices(text: str, node: str) -> list[Gpu]:
    """`hami.io/node-nvidia-register` in the JSON form (HAMi >= 2.8) or the older one.

    Raises:
        ValueError: neither form.
    """
    text = text.strip()
    if text.startswith("["):
        items = json.loads(text)
        return [Gpu(str(d.get("id", "")), node, int(d.get("count") or 0),
                    int(d.get("devmem") or 0), int(d.get("devcore") or 0),
                    str(d.get("type") or ""), bool(d.get("health"))) for d in items]
    gpus = []
    for part in text.split(":"):
        if not part:
            continue
        items = part.split(",")
        if len(items) not in (7, 9):
            raise ValueError(f"unexpected field count {len(items)} in {part!r}")
        gpus.append(Gpu(items[0], node, int(items[1]), int(items[2]), int(items[3]), items[4],
                        items[6].strip().lower() == "true"))
    return gpus


def parse_pod_devices(text: str) -> list[tuple[str, int, int]]:
    """(uuid, usedmem, usedcores) of every GPU in `hami.io/vgpu-devices-allocated`."""
    out = []
    for container in text.split(";"):
        for dev in container.split(":"):
            items = dev.split(",")
            if len(items) >= 4:
                out.append((items[0], int(items[2]), int(items[3])))
    return out


def _slice(spec: JobSpec, gpu: Gpu) -> tuple[int, int]:
    """(MiB, cores) one slice of `spec` takes on `gpu`, as HAMi resolves the request."""
    c = spec.cluster
    exclusive_mem = c.gpumem is None and c.gpumem_percentage in (None, 100)
    mem = (c.gpumem if isinstance(c.gpumem, int)
           else gpu.devmem * (c.gpumem_percentage or 100) // 100)
    # no cores and the whole memory: HAMi >= 2.7 makes it an exclusive card (cores 100)
    cores = c.gpucores if c.gpucores is not None else (100 if exclusive_mem else 0)
    return mem, min(cores, 100)


def _node_ok(node: Mapping[str, Any], spec: JobSpec) -> bool:
    meta, nspec = node.get("metadata") or {}, node.get("spec") or {}
    if nspec.get("unschedulable"):
        return False
    ready = [c for c in (node.get("status") or {}).get("conditions") or []
             if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return False
    labels = meta.get("labels") or {}
    return all(labels.get(k) == v for k, v in spec.cluster.node_selector.items())


def _type_ok(gpu: Gpu, spec: JobSpec) -> bool:
    """use-gputype / nouse-gputype: case-insensitive substrings (HAMi CheckType)."""
    kind = gpu.type.upper()
    use, nouse = spec.cluster.gpu_type, spec.cluster.gpu_type_exclude
    if use and not any(t.upper() in kind for t in use):
        return False
    return not any(t.upper() in kind for t in nouse)


def cluster_gpus(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                 spec: JobSpec) -> tuple[list[Gpu], list[str]]:
    """The GPUs this job may use, with the running pods' allocations subtracted; and
    notes on annotations that could not be read."""
    gpus: dict[str, Gpu] = {}
    notes = []
    for node in nodes:
        meta = node.get("metadata") or {}
        text = (meta.get("annotations") or {}).get(REGISTER)
        if not text or not _node_ok(node, spec):
            continue
        try:
            for gpu in parse_node_devices(text, meta.get("name", "?")):
                if _type_ok(gpu, spec):
                    gpus[gpu.uuid] = gpu
        except (ValueError, TypeError, AttributeError) as exc:
            notes.append(f"node {meta.get('name')}: {REGISTER} unreadable ({exc})")
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in _DONE:
            continue
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ALLOCATED)
        try:
            for uuid, mem, cores in parse_pod_devices(text or ""):
                if uuid in gpus:
                    gpus[uuid].take(mem, cores)
        except ValueError as exc:
            notes.append(f"pod {(pod.get('metadata') or {}).get('name')}: {ALLOCATED} "
                         f"unreadable ({exc})")
    return list(gpus.values()), notes


def _free_slices(gpus: list[Gpu], spec: JobSpec) -> dict[str, int]:
    """How many slices of this job's size each node can hold now."""
    free: dict[str, int] = {}
    for gpu in gpus:
        mem, cores = _slice(spec, gpu)
        probe = Gpu(**{**gpu.__dict__})
        n = 0
        while probe.takes(mem, cores) and n < probe.count:
            probe.take(mem, cores)
            n += 1
        free[gpu.node] = free.get(gpu.node, 0) + n
    return free


def _place_pod(gpus: list[Gpu], spec: JobSpec, free: dict[str, int]) -> bool:
    """Take `cluster.gpus` distinct GPUs on one node (most free slices first)."""
    for node in sorted(free, key=lambda n: -free[n]):
        fitting = [g for g in gpus if g.node == node and g.takes(*_slice(spec, g))]
        if len(fitting) >= spec.cluster.gpus:
            for g in fitting[:spec.cluster.gpus]:
                g.take(*_slice(spec, g))
            free[node] = _free_slices([g for g in gpus if g.node == node], spec).get(node, 0)
            return True
    return False


def _size(spec: JobSpec) -> str:
    c = spec.cluster
    mem = (f"{c.gpumem} MiB" if isinstance(c.gpumem, int) else
           f"{c.gpumem_percentage}% of a GPU" if c.gpumem_percentage else "a whole GPU")
    cores = f" and {c.gpucores}% cores" if c.gpucores else ""
    return mem + cores


def gang_fit(spec: JobSpec, nodes: Iterable[Mapping[str, Any]],
             pods: Iterable[Mapping[str, Any]]) -> Fit:
    """Can every pod of `spec` be placed on the cluster's free HAMi slices right now?"""
    n, per_pod = pod_count(spec), spec.cluster.gpus
    gpus, notes = cluster_gpus(nodes, pods, spec)
    free = _free_slices(gpus, spec)
    slices = "slice" if per_pod == 1 else "slices"
    need = f"needs {n} pod{'s' if n > 1 else ''} × {per_pod} {slices} of {_size(spec)}"
    shown = ", ".join(f"node {node}: {k} slice{'s' if k != 1 else ''}"
                      for node, k in sorted(free.items())) or "no HAMi GPU node"
    placed, left = 0, dict(free)
    while placed < n and _place_pod(gpus, spec, left):
        placed += 1
    extra = "".join(f"; {note}" for note in notes)
    if placed == n:
        return Fit(True, f"{need}; free now: {shown}{extra}", free)
    return Fit(False, f"{need}; free now: {shown} (room for {placed} of the {n} pods)"
                      f"{extra}", free)
