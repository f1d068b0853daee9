"""apply / status / logs / delete of rendered jobs on a cluster (`Cluster`).

    cluster = Cluster.from_kubeconfig()              # KUBECONFIG, ~/.kube/config, K3s's file
    cluster.apply(render(spec).objects)              # created / unchanged / replaced
    cluster.status("default", "mnist-ddp").pods      # phase, restarts, node, GPUs per pod
    cluster.logs("default", "mnist-ddp", follow=True, out=print)
    cluster.delete_job("default", "mnist-ddp")

The verbs only; what they stand on has a module each: `api.KubeApi` (the raw calls, the
only importer of `kubernetes`, and only when a Cluster is built, so `render` and `--help`
work without it), `objects` (names, render hashes, what is disttrain's), `pod_status`
(what a pod's object says), `kubeconfig` (which file). `Cluster(api_client)` takes any
`kubernetes.client.ApiClient` (tests point one at a fake API server). Apply is
idempotent: each object carries a hash of its rendered form; an unchanged hash is a
no-op, a changed workload is deleted and created again (a running Pod's or Job's spec
cannot be updated in place). The names callers import from here stay importable here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from disttrain.errors import KubeError
from disttrain.k8s.api import KubeApi
from disttrain.k8s.kubeconfig import K3S_KUBECONFIG, find_kubeconfig
from disttrain.k8s.labels import LABEL_JOB
from disttrain.k8s.logtee import tee_tail
from disttrain.k8s.objects import (
    CLUSTER_SCOPED,
    WORKLOADS,
    ApplyResult,
    ObjectRef,
    is_ours,
    job_refs,
    ref_of,
    render_hash,
    stamp,
)
from disttrain.k8s.pending import verdict_from_pods
from disttrain.k8s.pod_status import (
    JobStatus,
    PodLog,
    PodStatus,
    container_of,
    pod_status,
    rank_key,
    workload_state,
)

__all__ = ["CLUSTER_SCOPED", "K3S_KUBECONFIG", "WORKLOADS", "ApplyResult", "Cluster", "JobStatus",
           "KubeError", "ObjectRef", "PodLog", "PodStatus", "find_kubeconfig", "job_refs",
           "ref_of", "stamp"]


class Cluster(KubeApi):
    """The verbs of `disttrain k8s` on one cluster, over `KubeApi`'s raw operations."""

    # -- verbs ----------------------------------------------------------------------
    def apply(self, objects: list[dict[str, Any]]) -> list[ApplyResult]:
        """Create what is missing, replace what changed, leave the rest (idempotent)."""
        results = []
        for obj in objects:
            want, ref = stamp(obj), ref_of(obj)
            have = self.get(ref)
            if have is None:
                self.create(want)
                results.append(ApplyResult(ref, "created"))
            elif render_hash(have) == render_hash(want):
                results.append(ApplyResult(ref, "unchanged"))
            elif ref.kind == "PersistentVolumeClaim":
                results.append(ApplyResult(ref, "kept"))  # never throw data away
            elif ref.kind in ("ConfigMap", "Service"):
                want["metadata"]["resourceVersion"] = have["metadata"].get("resourceVersion")
                self._call(ref.kind, "replace", ref.namespace, ref.name, want)
                results.append(ApplyResult(ref, "replaced"))
            else:
                self.delete(ref)
                self.create(want)
                results.append(ApplyResult(ref, "replaced"))
        results += self._prune(objects)
        return results

    def _prune(self, objects: list[dict[str, Any]]) -> list[ApplyResult]:
        """Remove this job's objects the new render no longer has (its kind changed)."""
        workload = next((o for o in objects if o["kind"] in WORKLOADS), None)
        if workload is None:
            return []
        ref, out = ref_of(workload), []
        wanted = {ref_of(o) for o in objects}
        for old in job_refs(ref.namespace, ref.name):
            if old in wanted:
                continue
            have = self.get(old)
            if have and is_ours(have, ref.name):
                self.delete(old)
                out.append(ApplyResult(old, "pruned"))
        return out

    def status(self, namespace: str, name: str) -> JobStatus:
        """Each pod's phase, restarts, node, GPU resources and scheduler warnings."""
        workloads = []
        for kind in WORKLOADS:
            obj = self.get(ObjectRef(kind, namespace, name))
            if obj and is_ours(obj, name):
                workloads.append(f"{kind}/{name}: {workload_state(obj)}")
        raw = self.list("Pod", namespace, f"{LABEL_JOB}={name}")
        events = self._scheduling_events(namespace, raw)
        pods = [pod_status(p, events) for p in raw]
        if not workloads and not pods:
            raise KubeError(f"no disttrain job {name!r} in namespace {namespace} "
                            f"(looked for label {LABEL_JOB}={name})")
        pods.sort(key=lambda p: (rank_key(p.rank), p.name))
        return JobStatus(namespace, name, workloads, pods, verdict_from_pods(raw, events))

    def _scheduling_events(self, namespace: str, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The namespace's FailedScheduling events, read only when a pod is still Pending."""
        if not any((p.get("status") or {}).get("phase") in (None, "Pending") for p in pods):
            return []
        found = self._call("Event", "list", namespace)
        return [e for e in (found or {}).get("items") or []
                if e.get("reason") == "FailedScheduling"]

    def logs(self, namespace: str, name: str, *, follow: bool, out: Callable[[str], None],
             wait_s: float = 600.0) -> list[PodLog]:
        """Print every pod's log with a `[rank pod]` prefix; returns each pod's log tail."""
        selector = f"{LABEL_JOB}={name}"
        pods = self._wait_pods(namespace, selector, wait_s if follow else 0.0)
        if not pods:
            raise KubeError(f"no pods of disttrain job {name!r} in namespace {namespace}")
        lock, logs = threading.Lock(), {}

        def pump(pod: dict[str, Any]) -> None:
            status = pod_status(pod)
            prefix = f"[rank {status.rank} {status.name}]"
            tail: list[str] = []
            if follow:
                self._wait_started(namespace, status.name, wait_s, selector)
            try:
                tee_tail(self.pod_log(namespace, status.name, container_of(pod), follow), prefix,
                         tail, lock, out)
            except KubeError as exc:
                with lock:
                    out(f"{prefix} (no log: {exc})")
            logs[status.name] = (prefix, "\n".join(tail))

        threads = [threading.Thread(target=pump, args=(p,), daemon=True) for p in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        final = {p.name: p for p in (pod_status(x) for x in self.list("Pod", namespace, selector))}
        return [PodLog(pod, prefix, text, final[pod].failed if pod in final else False)
                for pod, (prefix, text) in sorted(logs.items())]

    def delete_job(self, namespace: str, name: str) -> list[ObjectRef]:
        """Delete the job's workload, Service and ConfigMap (PVCs are kept: they hold data)."""
        deleted = []
        for ref in job_refs(namespace, name):
            have = self.get(ref)
            if have is None or not is_ours(have, name):
                continue  # not ours: never delete what disttrain did not create
            if self.delete(ref):
                deleted.append(ref)
        if not deleted:
            raise KubeError(f"no disttrain job {name!r} in namespace {namespace}")
        return deleted

    # -- waiting ------------------------------------------------------------------------
    def _wait_pods(self, namespace: str, selector: str, wait_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + wait_s
        while True:
            pods = self.list("Pod", namespace, selector)
            if pods or time.monotonic() >= deadline:
                return pods
            time.sleep(self.poll_s)

    def _wait_started(self, namespace: str, pod: str, wait_s: float, selector: str) -> None:
        """Until `pod` runs; a pod still Pending when another of its job has failed (the
        rendezvous deadline passed without it) is waited for no longer."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            have = self.get(ObjectRef("Pod", namespace, pod))
            if have is None or (have.get("status") or {}).get("phase") != "Pending":
                return
            if any(pod_status(p).failed for p in self.list("Pod", namespace, selector)):
                return
            time.sleep(self.poll_s)
