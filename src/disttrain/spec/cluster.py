"""The `cluster` section of a JobSpec: where and how the job runs on Kubernetes (K3s + HAMi).

    cluster:
      kind: job                 # pod | job | pytorchjob
      image: 117.50.188.237:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime
      gpus: 2
      gpumem: 12000             # MiB per GPU ('12k' is read as 12000)

A leaf module (pydantic only) so `spec/job.py` stays import-light. The renderer in
`disttrain.k8s.render` turns a JobSpec with this section into Kubernetes objects; the
HAMi rules checked here (units, ranges; docs/cluster.md, "HAMi resources and their
units") are checked at load time, so a bad value is reported with its field name before
anything is rendered or applied.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from disttrain.spec.fields import (
    VGPU_WORKAROUNDS,
    NcclPreset,
    StrictModel,
    VgpuWorkaround,
    check_quantity,
    is_dns1123_label,
    is_dns1123_subdomain,
)

__all__ = ["GPU_POLICIES", "VGPU_WORKAROUNDS", "ClusterSpec", "CodeSource", "GpuMemOverhead",
           "RequestLimit",
           "VolumeSpec", "parse_gpumem"]
# A GPU with 1 TiB of memory does not exist: anything above is a unit mistake.
GPUMEM_MAX_MIB = 1024 * 1024
GPU_POLICIES = ("binpack", "spread", "topology-aware", "mutex", "numa")
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*\s*([<>=!~]=?[^\s;'\"`$\\]*)?$")


def parse_gpumem(value: int | str) -> int:
    """`nvidia.com/gpumem` as HAMi reads it: a plain integer number of MiB per GPU.

    HAMi takes the quantity's integer value as MiB, so the guide's `"12k"` is 12000 MiB,
    while `8Gi` would be 8589934592 MiB and is dropped by HAMi (pkg/device/nvidia/device.go
    GenerateResourceRequests). Only integers and the `k` (x1000) form are accepted.

    Example: parse_gpumem("12k") == 12000
    """
    text = str(value).strip()
    if isinstance(value, bool):
        raise ValueError("must be a number of MiB per GPU, e.g. 12000")
    match = re.fullmatch(r"(\d+)(k?)", text)
    if not match:
        hint = ""
        unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|M|G|T|MB|GB|MiB|GiB)", text)
        if unit:
            number, suffix = float(unit.group(1)), unit.group(2)
            factor = {"Gi": 1024, "GiB": 1024, "G": 1000, "GB": 1000, "Ti": 1024 * 1024,
                      "T": 1000 * 1000, "Mi": 1, "MiB": 1, "M": 1, "MB": 1, "Ki": 1 / 1024}[suffix]
            hint = (f"; HAMi reads the value as MiB, so {text} would not mean what it says: "
                    f"write {round(number * factor)} for {text}")
        raise ValueError(f"must be an integer number of MiB per GPU (e.g. 12000, or '12k' "
                         f"= 12000){hint}")
    mib = int(match.group(1)) * (1000 if match.group(2) else 1)
    if mib < 1:
        raise ValueError("must be at least 1 MiB; omit it to give the pod whole GPUs")
    if mib > GPUMEM_MAX_MIB:
        raise ValueError(f"{mib} MiB per GPU is more memory than any GPU has "
                         f"(limit {GPUMEM_MAX_MIB}); the unit is MiB, e.g. 12000 for ~12 GB")
    return mib


def _comma_list(value: Any) -> Any:
    """Lists given on the command line as 'a,b' (or YAML '[a, b]') become lists."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError("must be an absolute path inside the container, e.g. /workspace")
    return path.rstrip("/") or "/"


class RequestLimit(StrictModel):
    """A Kubernetes resource quantity as request and limit (e.g. cpu 2 / 8)."""

    request: str | None = None
    limit: str | None = None

    @field_validator("request", "limit", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> str | None:
        return check_quantity(None if v is None else str(v), "quantity")


class CodeSource(StrictModel):
    """Where the pod finds the training script: ConfigMap (default), hostPath or a PVC.

    The ConfigMap way needs nothing on the nodes (no `sudo cp` of the script onto each);
    hostPath, the way a hand-written Pod usually does it, pins the job to nodes holding
    the files.
    """

    configmap: bool | None = Field(None, description="ship script + files in a ConfigMap")
    host_path: str | None = Field(None, description="node directory holding the code")
    pvc: str | None = Field(None, description="PersistentVolumeClaim holding the code")
    mount: str = Field("/workspace", description="where the code appears in the container")
    files: list[str] = Field(default_factory=list,
                             description="extra small local files shipped in the ConfigMap")

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str) -> str:
        return _absolute(v)

    @model_validator(mode="after")
    def _one_source(self) -> CodeSource:
        others = [n for n in ("host_path", "pvc") if getattr(self, n)]
        if len(others) > 1:
            raise ValueError("give one of host_path or pvc, not both")
        if others and self.configmap:
            raise ValueError(f"configmap: true and {others[0]} both given; pick one")
        if self.configmap is False and not others:
            raise ValueError("configmap is off but neither host_path nor pvc is given")
        if self.files and others:
            raise ValueError("files are shipped in the ConfigMap; with host_path/pvc put "
                             "them on that volume instead")
        return self

    @property
    def delivery(self) -> Literal["configmap", "host_path", "pvc"]:
        """How the code reaches the pod."""
        if self.host_path:
            return "host_path"
        if self.pvc:
            return "pvc"
        return "configmap"


class VolumeSpec(StrictModel):
    """An extra volume: an existing PVC (or one created with the job), or a hostPath."""

    name: str
    mount: str
    pvc: str | None = None
    host_path: str | None = None
    read_only: bool = False
    create: bool = Field(False, description="create the PVC with the job (needs size)")
    size: str | None = Field(None, description="storage request of a created PVC, e.g. 50Gi")
    storage_class: str | None = Field(None, description="StorageClass of a created PVC")
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany",
                         "ReadWriteOncePod"] = "ReadWriteOnce"

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str) -> str:
        return _absolute(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not is_dns1123_label(v):
            raise ValueError(f"volume name {v!r} must be a DNS-1123 label (e.g. 'data')")
        if v in ("code", "workspace", "jobspec", "dshm"):
            raise ValueError(f"volume name {v!r} is used by disttrain itself; pick another")
        return v

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> str | None:
        return check_quantity(None if v is None else str(v), "size")

    @model_validator(mode="after")
    def _source(self) -> VolumeSpec:
        if bool(self.pvc) == bool(self.host_path):
            raise ValueError(f"volume {self.name!r}: give exactly one of pvc or host_path")
        if self.pvc and not is_dns1123_subdomain(self.pvc):
            raise ValueError(f"volume {self.name!r}: pvc {self.pvc!r} is not a valid name")
        if self.create and not (self.pvc and self.size):
            raise ValueError(f"volume {self.name!r}: create: true needs pvc and size "
                             f"(e.g. size: 50Gi)")
        return self


class GpuMemOverhead(StrictModel):
    """Overrides of the slice constants of `disttrain.plan.slice` (None: its default,
    with the source named there): what HAMi charges a slice besides the tensors."""

    context_mib: int | None = Field(None, ge=0, description="CUDA context per process")
    nccl_mib: int | None = Field(None, ge=0, description="NCCL buffers per process (world > 1)")
    cublas_mib: int | None = Field(None, ge=0, description="cuBLAS workspaces per process")
    fragmentation: float | None = Field(None, ge=1.0, le=4.0,
                                        description="caching allocator reserved / allocated")
    round_mib: int | None = Field(None, ge=1, description="round the request up to this")


class ClusterSpec(StrictModel):
    """Kubernetes placement and resources; see docs/cluster.md."""

    kind: Literal["pod", "job", "pytorchjob", "jobset", "trainjob"] = Field(
        "pod", description="pod (one multi-GPU Pod) | job (Indexed Job + Service) | pytorchjob "
        "| jobset (JobSet: restarts all ranks) | trainjob (Kubeflow Trainer v2)"
    )
    queue: str | None = Field(
        None, description="Kueue LocalQueue: admit all pods of the job or none (docs/cluster.md)"
    )
    gang: Literal["coscheduling"] | None = Field(
        None, description="coscheduling: a scheduler-plugins PodGroup, so all pods start or none"
    )
    gang_timeout_s: int = Field(
        300, ge=1, le=24 * 3600, description="PodGroup scheduleTimeoutSeconds of --gang"
    )
    namespace: str = Field("default", description="Kubernetes namespace")
    image: str | None = Field(None, description="container image (required for the cluster)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="image pull policy"
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Secrets for a private registry (comma list)"
    )
    image_has_disttrain: bool = Field(
        False, description="the image has disttrain installed (needed by built-in jobs)"
    )
    install_disttrain: str | None = Field(
        None, description="pip requirement installed at pod start, e.g. 'disttrain==0.1.0'"
    )
    pip_index_url: str | None = Field(None, description="package mirror for install_disttrain")
    scheduler: str | None = Field("hami-scheduler", description="schedulerName of the pods")
    runtime_class: str | None = Field(None, description="runtimeClassName (K3s: nvidia)")
    node_selector: dict[str, str] = Field(default_factory=dict, description="pod nodeSelector")
    labels: dict[str, str] = Field(default_factory=dict, description="extra labels on objects")
    gpus: int = Field(1, ge=0, description="nvidia.com/gpu per pod (distinct physical GPUs)")
    gpumem: int | str | None = Field(
        None, description="nvidia.com/gpumem per GPU: MiB, '12k', or auto (the plan's "
        "request: docs/memory.md)")
    gpumem_overhead: GpuMemOverhead = Field(
        default_factory=lambda: GpuMemOverhead(),
        description="what a slice holds besides tensors (docs/memory.md): context_mib, "
                    "nccl_mib, cublas_mib, fragmentation, round_mib")
    gpumem_percentage: int | None = Field(
        None, ge=1, le=100, description="nvidia.com/gpumem-percentage 1-100"
    )
    gpucores: int | None = Field(None, ge=0, le=100, description="nvidia.com/gpucores 0-100")
    gpu_type: list[str] = Field(default_factory=list,
                                description="HAMi nvidia.com/use-gputype, e.g. A100,3090")
    gpu_type_exclude: list[str] = Field(default_factory=list,
                                        description="HAMi nvidia.com/nouse-gputype")
    gpu_uuid: list[str] = Field(default_factory=list, description="HAMi nvidia.com/use-gpuuuid")
    gpu_uuid_exclude: list[str] = Field(default_factory=list,
                                        description="HAMi nvidia.com/nouse-gpuuuid")
    gpu_policy: str | None = Field(
        None, description="hami.io/gpu-scheduler-policy: binpack|spread|topology-aware|mutex|numa"
    )
    node_policy: Literal["binpack", "spread"] | None = Field(
        None, description="hami.io/node-scheduler-policy"
    )
    cpu: RequestLimit = Field(default_factory=RequestLimit, description="cpu request/limit")
    memory: RequestLimit = Field(default_factory=RequestLimit, description="memory request/limit")
    code: CodeSource = Field(default_factory=CodeSource, description="where the script comes from")
    volumes: list[VolumeSpec] = Field(default_factory=list, description="extra volumes")
    env: dict[str, str] = Field(default_factory=dict, description="extra container env")
    nccl_preset: NcclPreset = Field(
        "default", description="NCCL environment preset"
    )
    nccl_socket_ifname: str | None = Field(None, description="NCCL_SOCKET_IFNAME, e.g. eth0")
    vgpu_workarounds: list[VgpuWorkaround] = Field(
        default_factory=list,
        description="opt-in NCCL-under-HAMi workarounds: no-p2p,no-shm,no-cumem-host,"
                    "no-vgpu-control (docs/cluster.md)",
    )
    add_capabilities: list[str] = Field(
        default_factory=list, description="Linux capabilities to add (all others are dropped)"
    )
    elastic_nodes: str | None = Field(
        None, description="pytorchjob elasticPolicy MIN:MAX nodes (workers only)"
    )
    shm: str | None = Field("2Gi", description="size of the memory-backed /dev/shm")

    @field_validator("gpu_type", "gpu_type_exclude", "gpu_uuid", "gpu_uuid_exclude",
                     "image_pull_secrets", "vgpu_workarounds", "add_capabilities", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _comma_list(v)

    @field_validator("gpumem", mode="before")
    @classmethod
    def _gpumem(cls, v: Any) -> int | str | None:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        return None if v is None else parse_gpumem(v)

    @field_validator("gpu_uuid", "gpu_uuid_exclude")
    @classmethod
    def _uuids(cls, v: list[str]) -> list[str]:
        for uuid in v:
            if not _GPU_UUID.fullmatch(uuid):
                raise ValueError(f"{uuid!r} is not a GPU UUID like GPU-03f69c50-207a-2038-"
                                 f"9b45-23cac89cb67d (see nvidia-smi -L)")
        return v

    @field_validator("gpu_policy")
    @classmethod
    def _gpu_policy(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = [p.strip() for p in v.split(",")]
        bad = [p for p in parts if p not in GPU_POLICIES]
        if bad or not parts:
            raise ValueError(f"unknown policy {', '.join(bad) or v!r}; use one of "
                             f"{', '.join(GPU_POLICIES)} (numa combines, e.g. 'binpack,numa')")
        return ",".join(parts)

    @field_validator("add_capabilities")
    @classmethod
    def _caps(cls, v: list[str]) -> list[str]:
        out = [c.upper().removeprefix("CAP_") for c in v]
        for cap in out:
            if not re.fullmatch(r"[A-Z_]+", cap):
                raise ValueError(f"{cap!r} is not a Linux capability name (e.g. IPC_LOCK)")
        return out

    @field_validator("shm", mode="before")
    @classmethod
    def _shm(cls, v: Any) -> str | None:
        if v in (None, "", 0, "0"):
            return None
        return check_quantity(str(v), "shm")

    @field_validator("queue")
    @classmethod
    def _queue(cls, v: str | None) -> str | None:
        if v is not None and not (is_dns1123_subdomain(v) and len(v) <= 63):
            raise ValueError(f"{v!r} is not a LocalQueue name (at most 63 lower-case letters, "
                             f"digits, '-' or '.'; it becomes a label value)")
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not is_dns1123_label(v):
            raise ValueError("must be a DNS-1123 label (lower case, digits, '-')")
        return v

    @field_validator("elastic_nodes")
    @classmethod
    def _elastic(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(r"(\d+):(\d+)", v.strip())
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise ValueError("must be MIN:MAX nodes with 1 <= MIN <= MAX, e.g. 1:4")
        return v.strip()

    @field_validator("install_disttrain")
    @classmethod
    def _requirement(cls, v: str | None) -> str | None:
        # It is put into a shell command line: allow requirement syntax only.
        if v is not None and not _REQUIREMENT.match(v.strip()):
            raise ValueError(f"{v!r} is not a pip requirement such as 'disttrain==0.1.0'")
        return None if v is None else v.strip()

    @field_validator("pip_index_url")
    @classmethod
    def _index_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s'\"`$\\]+", v):
            raise ValueError(f"{v!r} is not an http(s) URL of a package index")
        return v

    @model_validator(mode="after")
    def _hami(self) -> ClusterSpec:
        if self.gpumem is not None and self.gpumem_percentage is not None:
            raise ValueError("give gpumem (MiB) or gpumem_percentage, not both")
        asked = [n for n in ("gpumem", "gpumem_percentage", "gpucores")
                 if getattr(self, n) is not None]
        asked += [n for n in ("gpu_type", "gpu_type_exclude", "gpu_uuid", "gpu_uuid_exclude")
                  if getattr(self, n)]
        if self.gpus == 0 and asked:
            raise ValueError(f"{asked[0]} needs gpus >= 1 (HAMi shares a GPU only inside "
                             f"nvidia.com/gpu); set --gpus 1")
        if self.install_disttrain is None and self.pip_index_url is not None:
            raise ValueError("pip_index_url is used only with install_disttrain")
        return self
