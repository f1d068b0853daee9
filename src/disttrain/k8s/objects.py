"""The objects disttrain puts on a cluster, as the client names and compares them.

    ref_of(obj)                     # ObjectRef("Job", "default", "ddp")
    job_refs("default", "ddp")      # every object `render` may make for the job (no PVCs)
    stamp(obj)                      # obj with the hash of its rendered form (apply's no-op test)
    is_ours(have, "ddp")            # labelled with the job and made by disttrain, not a controller

Objects travel as plain dicts, the same ones `render` returns; these helpers are pure (no
`kubernetes` import), so apply / status / delete and their tests share one reading of a
name, a hash and an owner.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from disttrain.k8s.labels import ANNOTATION_RENDER_HASH, LABEL_JOB
from disttrain.k8s.workloads import runtime_name

WORKLOADS = ("Pod", "Job", "PyTorchJob", "JobSet", "TrainJob")
CLUSTER_SCOPED = ("ClusterTrainingRuntime",)  # ObjectRef namespace ""


@dataclass(frozen=True)
class ObjectRef:
    """One object in the cluster (rather than an 'ns:name' string)."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class ApplyResult:
    ref: ObjectRef
    action: str  # created | unchanged | replaced | kept | pruned


def job_refs(namespace: str, name: str) -> list[ObjectRef]:
    """Every object `render` can make for job `name`, except PVCs (they hold data); the
    workloads first, so the gang objects they use go last."""
    return [*(ObjectRef(kind, namespace, name) for kind in WORKLOADS),
            ObjectRef("Service", namespace, name),
            ObjectRef("ConfigMap", namespace, f"{name}-code"),
            ObjectRef("PodGroup", namespace, name),
            ObjectRef("ClusterTrainingRuntime", "", runtime_name(name, namespace))]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of `obj` annotated with the hash of its rendered form."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]
    out = json.loads(json.dumps(obj))
    out["metadata"].setdefault("annotations", {})[ANNOTATION_RENDER_HASH] = digest
    return out


def ref_of(obj: dict[str, Any]) -> ObjectRef:
    meta = obj["metadata"]
    namespace = "" if obj["kind"] in CLUSTER_SCOPED else meta.get("namespace", "default")
    return ObjectRef(obj["kind"], namespace, meta["name"])


def render_hash(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RENDER_HASH)


def labels_of(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def owned(obj: dict[str, Any]) -> bool:
    """Made by a controller (a Job's pods), not by disttrain directly."""
    return bool((obj.get("metadata") or {}).get("ownerReferences"))


def is_ours(obj: dict[str, Any], job: str) -> bool:
    """Labelled with job `job` and created by disttrain itself (not a controller's child):
    the only objects disttrain replaces, prunes or deletes."""
    return labels_of(obj).get(LABEL_JOB) == job and not owned(obj)
