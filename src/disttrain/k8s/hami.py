"""HAMi vGPU resources, annotations, NCCL presets and the known NCCL-under-vGPU workarounds.

    hami_resources(spec.cluster)     # {'nvidia.com/gpu': '2', 'nvidia.com/gpumem': '12000'}
    hami_annotations(spec.cluster)   # {'nvidia.com/use-gputype': 'A100', ...}
    nccl_env(spec.cluster)           # [('NCCL_DEBUG', 'INFO'), ...]

Facts (docs/cluster.md, "HAMi resources and their units"): HAMi keys go in `limits` (requests,
when present, must be equal); `nvidia.com/gpumem` is an integer MiB per GPU;
`nvidia.com/gpu: N` is N distinct physical GPUs, so one container must never run more
processes than it has GPUs (NCCL "Duplicate GPU detected", NVIDIA/nccl#418); a pod with
HAMi resources that reaches another scheduler is not managed by HAMi.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disttrain import envvars
from disttrain.errors import SpecError
from disttrain.spec.cluster import ClusterSpec
from disttrain.spec.fields import NCCL_PRESET_NAMES, VGPU_WORKAROUNDS

HAMI_SCHEDULER = "hami-scheduler"
GPU = "nvidia.com/gpu"
GPUMEM = "nvidia.com/gpumem"
GPUMEM_PERCENTAGE = "nvidia.com/gpumem-percentage"
GPUCORES = "nvidia.com/gpucores"
HAMI_KEYS = (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPUCORES, "nvidia.com/priority")
# Set by the HAMi scheduler when it binds a pod: their absence on a bound pod means
# another scheduler placed it, and then HAMi enforces none of the pod's vGPU limits.
HAMI_ALLOCATED = ("hami.io/vgpu-devices-allocated", "hami.io/vgpu-node", "hami.io/bind-phase",
                  "hami.io/vgpu-devices-to-allocate")

# The NCCL settings a multi-node GPU job usually needs one of (docs/cluster.md, "NCCL presets");
# NCCL_SOCKET_IFNAME comes from its own field.
NCCL_PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    "debug": {"NCCL_DEBUG": "INFO"},
    "no-ib": {"NCCL_IB_DISABLE": "1"},
    "no-p2p": {"NCCL_P2P_DISABLE": "1"},
    "ib": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "2"},
}


@dataclass(frozen=True)
class Workaround:
    """An opt-in env change that avoids a known crash or hang of NCCL under HAMi-core."""

    env: tuple[tuple[str, str], ...]
    issues: tuple[str, ...]
    why: str


WORKAROUNDS: dict[str, Workaround] = {
    "no-p2p": Workaround(
        (("NCCL_P2P_DISABLE", "1"),),
        ("https://github.com/Project-HAMi/HAMi/issues/1502",
         "https://github.com/Project-HAMi/HAMi/issues/2760"),
        "torchrun all_reduce segfaults on NVLink GPUs under libvgpu; P2P detection is "
        "intercepted anyway. Slower: traffic goes through host memory.",
    ),
    "no-shm": Workaround(
        (("NCCL_SHM_DISABLE", "1"),),
        ("https://github.com/Project-HAMi/HAMi/issues/1502",),
        "with no-p2p, the remaining intra-node crash is in the SHM transport. Slower: "
        "falls back to sockets.",
    ),
    "no-cumem-host": Workaround(
        (("NCCL_CUMEM_HOST_ENABLE", "0"),),
        ("https://github.com/Project-HAMi/HAMi-core/issues/187",
         "https://github.com/Project-HAMi/HAMi-core/issues/169",
         "https://github.com/Project-HAMi/HAMi/issues/1764"),
        "NCCL >= 2.26.3 calls cuMemCreate with a host location, which HAMi-core before "
        "v2.9.0 answers with 'Illegal device id' (segfault).",
    ),
    "no-vgpu-control": Workaround(
        (("CUDA_DISABLE_CONTROL", "true"),),
        ("https://github.com/Project-HAMi/HAMi/issues/2641",),
        "ctypes-loaded NCCL hangs in ncclCommInitRank under libvgpu. This turns HAMi's "
        "memory and core isolation OFF for the container: last resort.",
    ),
}

# The tables above hold the data of the spec's choices (`nccl_preset`, `vgpu_workarounds`,
# typed in disttrain.spec.fields): a name on one side only would be a KeyError at render.
if set(NCCL_PRESETS) != set(NCCL_PRESET_NAMES) or set(WORKAROUNDS) != set(VGPU_WORKAROUNDS):
    raise RuntimeError("k8s.hami tables and spec.fields choice lists differ")


def hami_resources(cluster: ClusterSpec) -> dict[str, str]:
    """The HAMi extended resources of one container, as quantity strings (for `limits`).

    Example:
        >>> hami_resources(ClusterSpec(gpus=2, gpumem="12k"))
        {'nvidia.com/gpu': '2', 'nvidia.com/gpumem': '12000'}
    """
    if cluster.gpus < 1:
        return {}
    out = {GPU: str(cluster.gpus)}
    if cluster.gpumem == "auto":   # `disttrain k8s render/apply` put the plan's number here
        raise SpecError("cluster.gpumem auto: the request comes from the memory plan, which "
                        "`disttrain k8s render/apply` make (plan.gate.resolve_gpumem); give a "
                        "number of MiB to render without it")
    if cluster.gpumem is not None:
        out[GPUMEM] = str(cluster.gpumem)
    if cluster.gpumem_percentage is not None:
        out[GPUMEM_PERCENTAGE] = str(cluster.gpumem_percentage)
    if cluster.gpucores is not None:
        out[GPUCORES] = str(cluster.gpucores)
    return out


def hami_annotations(cluster: ClusterSpec) -> dict[str, str]:
    """Pod annotations that steer the HAMi scheduler (type/UUID filters, policies).

    They must sit on the pod (for Jobs: the pod template), not on the Job (HAMi#1069).
    """
    out: dict[str, str] = {}
    pairs = (("nvidia.com/use-gputype", cluster.gpu_type),
             ("nvidia.com/nouse-gputype", cluster.gpu_type_exclude),
             ("nvidia.com/use-gpuuuid", cluster.gpu_uuid),
             ("nvidia.com/nouse-gpuuuid", cluster.gpu_uuid_exclude))
    for key, values in pairs:
        if values:
            out[key] = ",".join(values)
    if cluster.gpu_policy:
        out["hami.io/gpu-scheduler-policy"] = cluster.gpu_policy
    if cluster.node_policy:
        out["hami.io/node-scheduler-policy"] = cluster.node_policy
    return out


def nccl_env(cluster: ClusterSpec) -> list[tuple[str, str]]:
    """NCCL preset, NCCL_SOCKET_IFNAME and the opted-in vGPU workarounds, in that order."""
    env = dict(NCCL_PRESETS[cluster.nccl_preset])
    if cluster.nccl_socket_ifname:
        env[envvars.NCCL_SOCKET_IFNAME] = cluster.nccl_socket_ifname
    for name in cluster.vgpu_workarounds:
        env.update(dict(WORKAROUNDS[name].env))
    return list(env.items())


def check_processes(nproc: int, cluster: ClusterSpec, backend: str) -> None:
    """Refuse a pod that would put two ranks on one GPU, or NCCL without GPUs.

    Raises:
        SpecError: with the message for the user.
    """
    if cluster.gpus >= 1 and nproc > cluster.gpus:
        raise SpecError(
            f"launch.nproc_per_node: {nproc} processes per pod but cluster.gpus is "
            f"{cluster.gpus}; each rank needs its own GPU (nvidia.com/gpu: N is N physical "
            f"GPUs; two ranks on one GPU fail with NCCL 'Duplicate GPU detected'). Use "
            f"--nproc-per-node {cluster.gpus} or --gpus {nproc}")
    if cluster.gpus == 0 and backend == "nccl":
        raise SpecError("launch.backend: nccl needs GPUs but cluster.gpus is 0; "
                         "use --backend gloo or --gpus N")


def uses_hami(resources: Mapping[str, Any] | None) -> bool:
    """Does a container's limits/requests mapping ask for HAMi resources?"""
    return bool(resources) and any(k in HAMI_KEYS for k in resources or {})


def scheduler_warnings(pod: Mapping[str, Any], expected: str = HAMI_SCHEDULER) -> list[str]:
    """Warnings for a pod (API JSON) that asks HAMi resources but was not placed by HAMi.

    HAMi's webhook has failurePolicy Ignore, so when it is down such pods silently go
    to default-scheduler (HAMi#661, #1536) and either stay Pending or get whole GPUs.
    """
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    name = meta.get("name", "?")
    wants = any(uses_hami((c.get("resources") or {}).get("limits"))
                or uses_hami((c.get("resources") or {}).get("requests"))
                for c in spec.get("containers") or [])
    if not wants:
        return []
    scheduler = spec.get("schedulerName") or "default-scheduler"
    if scheduler != expected:
        return [f"pod {name} asks for HAMi vGPU resources but its schedulerName is "
                f"{scheduler!r}, not {expected!r}: HAMi does not manage it (check that the "
                f"HAMi webhook is running)"]
    annotations = meta.get("annotations") or {}
    if spec.get("nodeName") and not any(k in annotations for k in HAMI_ALLOCATED):
        return [f"pod {name} was bound to node {spec['nodeName']} without HAMi's "
                f"allocation annotation ({HAMI_ALLOCATED[0]}): another scheduler placed it, "
                f"so its GPU memory/core limits are not enforced"]
    return []
