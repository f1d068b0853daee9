"""apply / status / logs / delete of rendered jobs through the official `kubernetes` client.

    cluster = Cluster.from_kubeconfig()              # KUBECONFIG, ~/.kube/config, K3s's file
    cluster.apply(render(spec).objects)              # created / unchanged / replaced
    cluster.status("default", "mnist-ddp").pods      # phase, restarts, node, GPUs per pod
    cluster.logs("default", "mnist-ddp", follow=True, out=print)
    cluster.delete_job("default", "mnist-ddp")

This is the only module that imports `kubernetes`, and only when a Cluster is built from
a kubeconfig, so `render` and `--help` work without it. `Cluster(api_client)` takes any
`kubernetes.client.ApiClient` (tests point one at a fake API server). Objects travel as
plain dicts, the same ones `render` returns. Apply is idempotent: each object carries a
hash of its rendered form; an unchanged hash is a no-op, a changed workload is deleted
and created again (a running Pod's or Job's spec cannot be updated in place).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.errors import KubeError
from disttrain.k8s import hami
from disttrain.k8s.labels import ANNOTATION_RANK_OFFSET, ANNOTATION_RENDER_HASH, LABEL_JOB
from disttrain.k8s.logtee import tee_tail
from disttrain.k8s.pending import pending_reason, verdict_from_pods
from disttrain.k8s.workloads import runtime_name
from disttrain.spec.paths import check_readable_file, file_problem

K3S_KUBECONFIG = "/etc/rancher/k3s/k3s.yaml"
WORKLOADS = ("Pod", "Job", "PyTorchJob", "JobSet", "TrainJob")
_TYPED = {"Pod": ("core", "pod"), "Service": ("core", "service"),
          "ConfigMap": ("core", "config_map"), "Event": ("core", "event"),
          "PersistentVolumeClaim": ("core", "persistent_volume_claim"), "Job": ("batch", "job")}
_CUSTOM = {"PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
           "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
           "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
           "ClusterTrainingRuntime": ("trainer.kubeflow.org", "v1alpha1",
                                      "clustertrainingruntimes"),
           "PodGroup": ("scheduling.x-k8s.io", "v1alpha1", "podgroups")}
CLUSTER_SCOPED = ("ClusterTrainingRuntime",)  # ObjectRef namespace ""
# what a missing CRD means (docs/cluster.md, "The kinds" and "All pods or none")
_NEEDS = {"PyTorchJob": "the Kubeflow training operator (v1)",
          "JobSet": "the JobSet controller (v0.12)", "TrainJob": "Kubeflow Trainer v2.3",
          "ClusterTrainingRuntime": "Kubeflow Trainer v2.3",
          "PodGroup": "the scheduler-plugins PodGroup CRD (Coscheduling)"}



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


def find_kubeconfig(explicit: str | None = None) -> str:
    """The kubeconfig to use: `explicit`, $KUBECONFIG, ~/.kube/config, then K3s's file."""
    if explicit:
        check_readable_file(explicit, "--kubeconfig ", kind="kubeconfig", error=KubeError)
        return explicit
    env = os.environ.get(envvars.KUBECONFIG)
    if env:
        paths = [p for p in env.split(os.pathsep) if p]
        if any(file_problem(p) is None for p in paths):
            return env
        raise KubeError(f"KUBECONFIG={env}: no such file")
    for candidate in (Path.home() / ".kube" / "config", Path(K3S_KUBECONFIG)):
        if candidate.is_file():
            if not os.access(candidate, os.R_OK):
                raise KubeError(f"{candidate} is not readable; on a K3s server run as root "
                                f"or copy it: sudo cp {candidate} ~/.kube/config && "
                                f"sudo chown $USER ~/.kube/config")
            return str(candidate)
    raise KubeError("no kubeconfig found: set KUBECONFIG, create ~/.kube/config, or on a "
                    f"K3s server use {K3S_KUBECONFIG}; pass --kubeconfig PATH")


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


class Cluster:
    """Operations on one cluster through an injected `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any, wait_s: float = 120.0, poll_s: float = 1.0) -> None:
        from kubernetes import client

        self._api = api_client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.wait_s, self.poll_s = wait_s, poll_s

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> Cluster:
        from kubernetes import config

        found = find_kubeconfig(path)
        try:
            return cls(config.new_client_from_config(config_file=found, context=context))
        except Exception as exc:
            raise KubeError(f"kubeconfig {found}: {exc}") from None

    @property
    def server(self) -> str:
        return str(getattr(self._api.configuration, "host", "?"))

    # -- raw operations on dict objects -----------------------------------------------
    def _call(self, kind: str, verb: str, namespace: str, *args: Any, **kw: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        kw["_preload_content"] = False
        try:
            if verb == "list_all":  # every Node, or the Pods of every namespace
                resp = (self.core.list_node if kind == "Node"
                        else self.core.list_pod_for_all_namespaces)(**kw)
            elif kind in CLUSTER_SCOPED:
                group, version, plural = _CUSTOM[kind]
                method = getattr(self.custom, f"{verb}_cluster_custom_object")
                resp = method(group, version, plural, *args, **kw)
            elif kind in _CUSTOM:
                group, version, plural = _CUSTOM[kind]
                method = getattr(self.custom, f"{verb}_namespaced_custom_object")
                resp = method(group, version, namespace, plural, *args, **kw)
            else:
                api, suffix = _TYPED[kind]
                method = getattr(getattr(self, api), f"{verb}_namespaced_{suffix}")
                if verb in ("read", "replace", "delete"):
                    resp = method(args[0], namespace, *args[1:], **kw)
                else:
                    resp = method(namespace, *args, **kw)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise KubeError(_api_message(exc, kind, namespace)) from None
        except HTTPError as exc:
            raise KubeError(f"cannot reach the API server at {self.server}: {exc}") from None
        return json.loads(resp.data or b"null")

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        if ref.kind in _CUSTOM:
            return self._call(ref.kind, "get", ref.namespace, ref.name)
        return self._call(ref.kind, "read", ref.namespace, ref.name)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        ref = ref_of(obj)
        created = self._call(ref.kind, "create", ref.namespace, obj)
        if created is None:
            crd = f" (is {_NEEDS[ref.kind]} installed?)" if ref.kind in _NEEDS else ""
            where = f" in namespace {ref.namespace}" if ref.namespace else ""
            raise KubeError(f"creating {ref}{where}: not found{crd}")
        return created

    def delete(self, ref: ObjectRef, wait: bool = True) -> bool:
        """Delete `ref` (and, foreground, what it owns); True if it existed."""
        gone = self._call(ref.kind, "delete", ref.namespace, ref.name,
                          propagation_policy="Foreground") is None
        if gone:
            return False
        deadline = time.monotonic() + self.wait_s
        while wait and self.get(ref) is not None:
            if time.monotonic() > deadline:
                raise KubeError(f"{ref} is still being deleted after {self.wait_s:.0f}s; "
                                f"check `kubectl get {ref.kind.lower()} {ref.name} -o yaml`")
            time.sleep(self.poll_s)
        return True

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        found = self._call(kind, "list", namespace, label_selector=selector)
        return list((found or {}).get("items") or [])

    def list_all(self, kind: str) -> list[dict[str, Any]]:
        """Every Node, or every Pod of all namespaces (k8s/capacity.py reads HAMi's books)."""
        return list((self._call(kind, "list_all", "") or {}).get("items") or [])

    def pod_log(self, namespace: str, pod: str, container: str | None,
                follow: bool) -> Iterator[str]:
        """Lines of a pod's log; with `follow`, as they are written, until the pod ends."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.core.read_namespaced_pod_log(pod, namespace, container=container,
                                                     follow=follow, _preload_content=False)
        except ApiException as exc:
            raise KubeError(_api_message(exc, "Pod log", namespace)) from None
        buf = b""
        try:
            chunks = resp.stream(65536) if resp.chunked else iter(lambda: resp.read1(65536), b"")
            for chunk in chunks:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    yield line.decode("utf-8", "replace")
            if buf:
                yield buf.decode("utf-8", "replace")
        finally:
            resp.release_conn()

    def exec_read(self, namespace: str, pod: str, container: str | None, command: list[str],
                  timeout_s: float = 30.0) -> str:
        """stdout of `command` run in the pod's container (as `kubectl exec`), for
        `disttrain k8s top` reading the files the ranks write (monitor/pods.py)."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import stream

        try:
            return str(stream(self.core.connect_get_namespaced_pod_exec, pod, namespace,
                              container=container, command=command, stdin=False, stdout=True,
                              stderr=False, tty=False, _request_timeout=timeout_s))
        except ApiException as exc:
            raise KubeError(_api_message(exc, "Pod exec", namespace)) from None
        except Exception as exc:  # the websocket's own errors: a closed or refused stream
            raise KubeError(f"exec in pod {pod} (namespace {namespace}): {exc}") from None

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
            elif _hash(have) == _hash(want):
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
            if have and _labels(have).get(LABEL_JOB) == ref.name and not _owned(have):
                self.delete(old)
                out.append(ApplyResult(old, "pruned"))
        return out

    def status(self, namespace: str, name: str) -> JobStatus:
        """Each pod's phase, restarts, node, GPU resources and scheduler warnings."""
        workloads = []
        for kind in WORKLOADS:
            obj = self.get(ObjectRef(kind, namespace, name))
            if obj and _labels(obj).get(LABEL_JOB) == name and not _owned(obj):
                workloads.append(f"{kind}/{name}: {_workload_state(obj)}")
        raw = self.list("Pod", namespace, f"{LABEL_JOB}={name}")
        events = self._scheduling_events(namespace, raw)
        pods = [_pod_status(p, events) for p in raw]
        if not workloads and not pods:
            raise KubeError(f"no disttrain job {name!r} in namespace {namespace} "
                            f"(looked for label {LABEL_JOB}={name})")
        pods.sort(key=lambda p: (_rank_key(p.rank), p.name))
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
            status = _pod_status(pod)
            prefix = f"[rank {status.rank} {status.name}]"
            tail: list[str] = []
            if follow:
                self._wait_started(namespace, status.name, wait_s, selector)
            try:
                tee_tail(self.pod_log(namespace, status.name, _container(pod), follow), prefix,
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
        final = {p.name: p for p in (_pod_status(x) for x in self.list("Pod", namespace, selector))}
        return [PodLog(pod, prefix, text, final[pod].failed if pod in final else False)
                for pod, (prefix, text) in sorted(logs.items())]

    def delete_job(self, namespace: str, name: str) -> list[ObjectRef]:
        """Delete the job's workload, Service and ConfigMap (PVCs are kept: they hold data)."""
        deleted = []
        for ref in job_refs(namespace, name):
            have = self.get(ref)
            if have is None or _labels(have).get(LABEL_JOB) != name or _owned(have):
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
            if any(_pod_status(p).failed for p in self.list("Pod", namespace, selector)):
                return
            time.sleep(self.poll_s)


def _hash(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RENDER_HASH)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _owned(obj: dict[str, Any]) -> bool:
    """Made by a controller (a Job's pods), not by disttrain directly."""
    return bool((obj.get("metadata") or {}).get("ownerReferences"))


def _container(pod: dict[str, Any]) -> str | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    return containers[0].get("name") if containers else None


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


def _pod_status(pod: dict[str, Any], events: list[dict[str, Any]] | None = None) -> PodStatus:
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


def _workload_state(obj: dict[str, Any]) -> str:
    status = obj.get("status") or {}
    if obj.get("kind") == "Pod":
        return status.get("phase") or "Unknown"
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if conditions:
        last = conditions[-1]
        return last.get("type", "?") + (f" ({last['reason']})" if last.get("reason") else "")
    counts = [f"{k} {status[k]}" for k in ("active", "succeeded", "failed") if status.get(k)]
    return ", ".join(counts) or "created"


def _api_message(exc: Any, kind: str, namespace: str) -> str:
    try:
        body = json.loads(exc.body or "{}")
        detail = body.get("message") or exc.reason
    except (TypeError, ValueError):
        detail = exc.reason
    hint = {401: " (check the kubeconfig's credentials)",
            403: f" (your user may not manage {kind} in namespace {namespace})"}.get(exc.status, "")
    return f"API server refused {kind} in namespace {namespace}: {exc.status} {detail}{hint}"
