"""The `cluster` section of a JobSpec: where and how the job runs on Kubernetes (K3s + HAMi).

A leaf module (pydantic only) so `spec.py` stays import-light. The renderer in
`disttrain.k8s.render` turns a JobSpec with this section into Kubernetes objects.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RequestLimit(_Strict):
    """A Kubernetes resource quantity as request and limit (e.g. cpu 2 / 8)."""

    request: str | None = None
    limit: str | None = None


class CodeSource(_Strict):
    """Where the pod finds the training script: ConfigMap (default), hostPath or a PVC."""

    configmap: bool = True
    host_path: str | None = None
    pvc: str | None = None
    mount: str = "/workspace"


class VolumeSpec(_Strict):
    """An extra volume: an existing PVC (or one created with the job), or a hostPath."""

    name: str
    mount: str
    pvc: str | None = None
    host_path: str | None = None
    read_only: bool = False


class ClusterSpec(_Strict):
    """Kubernetes placement and resources; see docs/cluster.md."""

    kind: Literal["pod", "job", "pytorchjob"] = Field(
        "pod", description="pod (one multi-GPU Pod) | job (Indexed Job + Service) | pytorchjob"
    )
    namespace: str = Field("default", description="Kubernetes namespace")
    image: str | None = Field(None, description="container image (required for the cluster)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="image pull policy"
    )
    scheduler: str | None = Field("hami-scheduler", description="schedulerName of the pods")
    node_selector: dict[str, str] = Field(default_factory=dict, description="pod nodeSelector")
    gpus: int = Field(1, ge=0, description="nvidia.com/gpu per pod (distinct physical GPUs)")
    gpumem: int | str | None = Field(None, description="nvidia.com/gpumem per GPU: MiB or '12k'")
    gpumem_percentage: int | None = Field(None, description="nvidia.com/gpumem-percentage 1-100")
    gpucores: int | None = Field(None, description="nvidia.com/gpucores 0-100")
    cpu: RequestLimit = Field(default_factory=RequestLimit, description="cpu request/limit")
    memory: RequestLimit = Field(default_factory=RequestLimit, description="memory request/limit")
    code: CodeSource = Field(default_factory=CodeSource, description="where the script comes from")
    volumes: list[VolumeSpec] = Field(default_factory=list, description="extra volumes")
    env: dict[str, str] = Field(default_factory=dict, description="extra container env")
    nccl_preset: Literal["default", "debug", "no-ib", "no-p2p", "ib"] = Field(
        "default", description="NCCL environment preset"
    )
    shm: str | None = Field("2Gi", description="size of the memory-backed /dev/shm")
