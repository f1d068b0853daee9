"""Secure pod defaults and a Pod Security Standards "baseline" check of rendered objects.

    container_security(spec.cluster)   # allowPrivilegeEscalation false, drop ALL
    baseline_violations(objects)       # ['Pod/x: spec.volumes[0].hostPath (volume "code") ...']

The rules are those of k8s.io/pod-security-admission/policy (docs/cluster.md, "Security
defaults"). disttrain never renders privileged, hostNetwork, hostPID or hostIPC; HAMi v2.10 even
denies privileged containers that ask for vGPU resources. What a user can still opt into
(hostPath code or volumes, extra capabilities) is reported with the field that breaks
baseline, so a namespace that enforces it does not reject the job by surprise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from disttrain.spec.cluster import ClusterSpec

# Capabilities the baseline level allows to add (pod-security-admission capabilities_baseline).
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})


def container_security(cluster: ClusterSpec) -> dict[str, Any]:
    """The container securityContext: no privilege escalation, every capability dropped.

    runAsNonRoot is not set: the guide's pytorch/pytorch image runs as root, and forcing a
    user would break it; docs/cluster.md says how to go "restricted".
    """
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if cluster.add_capabilities:
        caps["add"] = list(cluster.add_capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": caps}


def pod_security() -> dict[str, Any]:
    """The pod securityContext: the runtime's default seccomp profile (baseline and restricted)."""
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def pod_specs(obj: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every pod spec inside a rendered object, with its field path."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind == "Pod":
        yield "spec", spec
    elif kind in ("Job", "Deployment", "StatefulSet", "PodTemplate"):
        yield "spec.template.spec", (spec.get("template") or {}).get("spec") or {}
    elif kind == "PyTorchJob":
        for rtype, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
            template = (replica or {}).get("template") or {}
            yield f"spec.pytorchReplicaSpecs.{rtype}.template.spec", template.get("spec") or {}
    elif kind in ("JobSet", "ClusterTrainingRuntime"):  # replicated Jobs (k8s/workloads.py)
        at = "spec" if kind == "JobSet" else "spec.template.spec"
        jobset = spec if kind == "JobSet" else (spec.get("template") or {}).get("spec") or {}
        for i, rjob in enumerate(jobset.get("replicatedJobs") or []):
            job = ((rjob or {}).get("template") or {}).get("spec") or {}
            yield (f"{at}.replicatedJobs[{i}].template.spec.template.spec",
                   (job.get("template") or {}).get("spec") or {})


def baseline_violations(objects: list[Mapping[str, Any]]) -> list[str]:
    """Fields of `objects` that a namespace enforcing PSS baseline would reject."""
    found: list[str] = []
    for obj in objects:
        who = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name', '?')}"
        for prefix, spec in pod_specs(obj):
            found += [f"{who}: {prefix}.{field}" for field in _pod_violations(spec)]
    return found


def _pod_violations(spec: Mapping[str, Any]) -> list[str]:
    out = [f"{key}: true (host namespaces)" for key in ("hostNetwork", "hostPID", "hostIPC")
           if spec.get(key)]
    for i, vol in enumerate(spec.get("volumes") or []):
        if "hostPath" in vol:
            out.append(f"volumes[{i}].hostPath (volume {vol.get('name')!r}; hostPath volumes)")
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, ctr in enumerate(spec.get(group) or []):
            where = f"{group}[{i}]"
            sc = ctr.get("securityContext") or {}
            if sc.get("privileged"):
                out.append(f"{where}.securityContext.privileged: true (privileged containers)")
            added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
            if added:
                out.append(f"{where}.securityContext.capabilities.add: {', '.join(sorted(added))}"
                           f" (capabilities beyond the baseline set)")
            for j, port in enumerate(ctr.get("ports") or []):
                if port.get("hostPort"):
                    out.append(f"{where}.ports[{j}].hostPort (host ports)")
    profile = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    if profile == "Unconfined":
        out.append("securityContext.seccompProfile.type: Unconfined (seccomp)")
    return out
