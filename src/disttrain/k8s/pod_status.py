"""What `disttrain k8s status` / `logs` say of a job's pods, read from the API's objects.

    pod_status(pod, events)         # PodStatus: rank, phase, restarts, node, GPUs, why Pending
    workload_state(job)             # 'Complete', 'Failed (BackoffLimitExceeded)', 'active 2'

Pure (dicts in, dataclasses out; no `kubernetes` import): a pod's rank comes from the
Indexed Job's completion index or, for a PyTorchJob, its replica index plus the offset
render() writes on the Worker template (`labels.ANNOTATION_RANK_OFFSET`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disttrain.k8s import hami
from disttrain.k8s.labels import ANNOTATION_RANK_OFFSET
from disttrain.k8s.pending import pending_reason


@dataclass
class PodStatus:
    name: str
    rank: str
    phase: str
    restarts: int
    node: str
    gpu: dict[str, str]
    scheduler: str
    exit_code: int | None
    warnings: list[str] = field(default_factory=list)
    pending: str | None = None  # 'Pending: 0/3 nodes are available: ...' (k8s/pending.py)

    @property
    def failed(self) -> bool:
        return self.phase == "Failed" or (self.exit_code not in (None, 0))


@dataclass
class JobStatus:
    namespace: str
    name: str
    workloads: list[str]  # e.g. ['Job/ddp: Complete']
    pods: list[PodStatus]
    verdict: str | None = None  # 'k of N ranks arrived; missing: pod X (Pending: ...)'


@dataclass
class PodLog:
    pod: str
    prefix: str
    text: str
    failed: bool


def container_of(pod: dict[str, Any]) -> str | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    return containers[0].get("name") if containers else None


def rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


def pod_status(pod: dict[str, Any], events: list[dict[str, Any]] | None = None) -> PodStatus:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    status = pod.get("status") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    rank = (notes.get("batch.kubernetes.io/job-completion-index")
            or labels.get("batch.kubernetes.io/job-completion-index"))
    rtype = labels.get("training.kubeflow.org/replica-type")
    if rank is None and rtype:
        # Workers come after the Master; render() marks that offset on the Worker template.
        index = int(labels.get("training.kubeflow.org/replica-index", "0"))
        rank = str(index + int(notes.get(ANNOTATION_RANK_OFFSET, "0")))
    restarts, exit_code = 0, None
    for cs in status.get("containerStatuses") or []:
        restarts += int(cs.get("restartCount") or 0)
        term = (cs.get("state") or {}).get("terminated")
        if term is not None:
            exit_code = int(term.get("exitCode") or 0)
    limits: dict[str, str] = {}
    for ctr in spec.get("containers") or []:
        for key, value in ((ctr.get("resources") or {}).get("limits") or {}).items():
            if key in hami.HAMI_KEYS:
                limits[key.removeprefix("nvidia.com/")] = str(value)
    return PodStatus(name=meta.get("name", "?"), rank=rank or "0",
                     phase=status.get("phase") or "Unknown", restarts=restarts,
                     node=spec.get("nodeName") or "-", gpu=limits,
                     scheduler=spec.get("schedulerName") or "default-scheduler",
                     exit_code=exit_code, warnings=hami.scheduler_warnings(pod),
                     pending=pending_reason(pod, events or []))


def workload_state(obj: dict[str, Any]) -> str:
    status = obj.get("status") or {}
    if obj.get("kind") == "Pod":
        return status.get("phase") or "Unknown"
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if conditions:
        last = conditions[-1]
        return last.get("type", "?") + (f" ({last['reason']})" if last.get("reason") else "")
    counts = [f"{k} {status[k]}" for k in ("active", "succeeded", "failed") if status.get(k)]
    return ", ".join(counts) or "created"
