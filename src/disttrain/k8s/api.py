"""The raw operations on one cluster, through the official `kubernetes` client, on plain
dict objects: get / create / delete / list, a pod's log lines, a command's output in a pod.

    api = KubeApi.from_kubeconfig()                  # `kubeconfig.find_kubeconfig`
    api.get(ObjectRef("Job", "default", "ddp"))      # the object as a dict, or None (404)
    api.create(obj); api.delete(ref)                 # delete waits until it is gone

One `_call` maps a kind and a verb onto the typed API (core, batch) or the custom-objects
API (the CRDs: PyTorchJob, JobSet, TrainJob, PodGroup, ClusterTrainingRuntime), asks for
the raw JSON (`_preload_content=False`: the same dicts `render` makes), and turns the
client's errors into one `KubeError` line (who refused what, and what to check). The only
importer of `kubernetes`, and only inside the methods, so `render` and `--help` work
without it. `k8s.client.Cluster` adds the verbs (apply, status, logs, delete_job).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from disttrain.errors import KubeError
from disttrain.k8s.kubeconfig import find_kubeconfig
from disttrain.k8s.objects import CLUSTER_SCOPED, ObjectRef, ref_of

_TYPED = {"Pod": ("core", "pod"), "Service": ("core", "service"),
          "ConfigMap": ("core", "config_map"), "Event": ("core", "event"),
          "PersistentVolumeClaim": ("core", "persistent_volume_claim"), "Job": ("batch", "job")}
_CUSTOM = {"PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
           "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
           "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
           "ClusterTrainingRuntime": ("trainer.kubeflow.org", "v1alpha1",
                                      "clustertrainingruntimes"),
           "PodGroup": ("scheduling.x-k8s.io", "v1alpha1", "podgroups")}
# what a missing CRD means (docs/cluster.md, "The kinds" and "All pods or none")
_NEEDS = {"PyTorchJob": "the Kubeflow training operator (v1)",
          "JobSet": "the JobSet controller (v0.12)", "TrainJob": "Kubeflow Trainer v2.3",
          "ClusterTrainingRuntime": "Kubeflow Trainer v2.3",
          "PodGroup": "the scheduler-plugins PodGroup CRD (Coscheduling)"}

_Api = TypeVar("_Api", bound="KubeApi")


class KubeApi:
    """Operations on one cluster through an injected `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any, wait_s: float = 120.0, poll_s: float = 1.0) -> None:
        from kubernetes import client

        self._api = api_client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.wait_s, self.poll_s = wait_s, poll_s

    @classmethod
    def from_kubeconfig(cls: type[_Api], path: str | None = None,
                        context: str | None = None) -> _Api:
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


def _api_message(exc: Any, kind: str, namespace: str) -> str:
    try:
        body = json.loads(exc.body or "{}")
        detail = body.get("message") or exc.reason
    except (TypeError, ValueError):
        detail = exc.reason
    hint = {401: " (check the kubeconfig's credentials)",
            403: f" (your user may not manage {kind} in namespace {namespace})"}.get(exc.status, "")
    return f"API server refused {kind} in namespace {namespace}: {exc.status} {detail}{hint}"
