"""The pods a cluster would create from rendered objects, as `k8s run-local` runs them.

    pods = local_pods(render(spec, local=True).objects, spec)
    pods[1].argv, pods[1].env            # $(VAR)-expanded command, the pod's env

Each workload kind is emulated by what its controller does: a Job's pods `<job>-<i>` with
their completion index; the training operator's PyTorchJob pods and the env it injects;
the JobSet controller's `<jobset>-<rjob>-<job>-<pod>` pods in the JobSet's subdomain; and
Kubeflow Trainer's TrainJob as its runtime's JobSet with the trainer fields and the
PET_* env of Trainer's torch plugin (k8s/workloads.py names the sources).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disttrain.errors import LocalRunError
from disttrain.k8s.netns import pod_address
from disttrain.spec.job import JobSpec

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class LocalPod:
    """One pod as run-local runs it."""

    name: str
    hostname: str
    aliases: tuple[str, ...]  # DNS names that resolve to this pod, canonical first
    address: str
    argv: tuple[str, ...]  # container command, $(VAR)-expanded, container paths
    env: dict[str, str]
    working_dir: str | None
    mounts: tuple[dict[str, Any], ...]
    volumes: dict[str, dict[str, Any]]




def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` is a literal `$`."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def local_pods(objects: list[dict[str, Any]], spec: JobSpec) -> list[LocalPod]:
    """The pods the cluster would create from `objects`, with their env resolved."""
    pods: list[LocalPod] = []
    ns = spec.cluster.namespace
    for obj in objects:
        if obj["kind"] == "Pod":
            pods.append(_pod(obj["spec"], obj["metadata"]["name"], [], len(pods), {}))
        elif obj["kind"] == "Job":
            svc = obj["spec"]["template"]["spec"].get("subdomain")
            for i in range(int(obj["spec"]["completions"])):
                host = f"{obj['metadata']['name']}-{i}"
                aliases = [f"{host}.{svc}.{ns}.svc.cluster.local", f"{host}.{svc}"] if svc else []
                pods.append(_pod(obj["spec"]["template"]["spec"], host, aliases, len(pods),
                                 {"index": str(i)}))
        elif obj["kind"] == "PyTorchJob":
            pods += _pytorchjob_pods(obj, ns, start=len(pods))
        elif obj["kind"] == "JobSet":
            pods += _jobset_pods(obj, ns, start=len(pods))
        elif obj["kind"] == "TrainJob":
            pods += _trainjob_pods(obj, objects, ns, start=len(pods))
    if not pods:
        raise LocalRunError("the rendered objects hold no pod to run")
    return pods


def _pytorchjob_pods(obj: dict[str, Any], ns: str, start: int) -> list[LocalPod]:
    """Emulate the training operator: one pod per replica and the env it injects."""
    spec, name = obj["spec"], obj["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    elastic = spec.get("elasticPolicy")
    total = sum(int(r["replicas"]) for r in replicas.values())
    nproc = spec.get("nprocPerNode", "1")
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        podspec = replicas[rtype]["template"]["spec"]
        port = str(podspec["containers"][0]["ports"][0]["containerPort"])
        for i in range(int(replicas[rtype]["replicas"])):
            host = f"{name}-{rtype.lower()}-{i}"
            op = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc}
            if "Master" in replicas:
                rank = str(i if rtype == "Master" else i + 1)
                master = f"{name}-master-0"
                op |= {"MASTER_ADDR": master, "PET_MASTER_ADDR": master, "MASTER_PORT": port,
                       "PET_MASTER_PORT": port, "RANK": rank, "PET_NODE_RANK": rank,
                       "PET_NNODES": str(total), "WORLD_SIZE": str(total * int(nproc))}
            if elastic:
                nodes = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
                op |= {"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}",
                       "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
                       "PET_NNODES": nodes, "PET_RDZV_ID": elastic.get("rdzvId", name),
                       "PET_MAX_RESTARTS": str(elastic.get("maxRestarts", 0))}
            aliases = [f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}"]
            pods.append(_pod(podspec, host, aliases, start + len(pods), {}, extra_env=op))
    return pods


def _jobset_pods(obj: dict[str, Any], ns: str, start: int,
                 extra_env: Callable[[int], dict[str, str]] | None = None) -> list[LocalPod]:
    """Emulate the JobSet controller: `<jobset>-<rjob>-<job>-<pod>` hostnames in the
    JobSet's subdomain, each pod's Job completion index."""
    name, spec = obj["metadata"]["name"], obj["spec"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    pods = []
    for rjob in spec["replicatedJobs"]:
        jspec = rjob["template"]["spec"]
        for j in range(int(rjob.get("replicas", 1))):
            for i in range(int(jspec.get("completions") or jspec.get("parallelism") or 1)):
                host = f"{name}-{rjob['name']}-{j}-{i}"
                aliases = [f"{host}.{subdomain}.{ns}.svc.cluster.local", f"{host}.{subdomain}"]
                pods.append(_pod(jspec["template"]["spec"], host, aliases, start + len(pods),
                                 {"index": str(i)},
                                 extra_env=extra_env(i) if extra_env else None))
    return pods


def _trainjob_pods(obj: dict[str, Any], objects: list[dict[str, Any]], ns: str,
                   start: int) -> list[LocalPod]:
    """Emulate Kubeflow Trainer: the runtime's JobSet with the TrainJob's trainer fields
    on container `node`, numNodes pods, and the PET_* env of its torch plugin."""
    name, trainer = obj["metadata"]["name"], obj["spec"].get("trainer") or {}
    ref = obj["spec"]["runtimeRef"]["name"]
    runtime = next((o for o in objects if o["kind"] == "ClusterTrainingRuntime"
                    and o["metadata"]["name"] == ref), None)
    if runtime is None:
        raise LocalRunError(f"TrainJob {name}: its runtime {ref} is not among the rendered objects")
    jobset = {"metadata": {"name": name}, "spec": copy.deepcopy(runtime["spec"]["template"]["spec"])}
    nodes = int(trainer.get("numNodes") or runtime["spec"]["mlPolicy"].get("numNodes") or 1)
    for rjob in jobset["spec"]["replicatedJobs"]:
        rjob["template"]["spec"]["completions"] = nodes
        ctr = next(c for c in rjob["template"]["spec"]["template"]["spec"]["containers"]
                   if c["name"] == "node")
        for key in ("image", "command", "args"):
            if key in trainer:
                ctr[key] = trainer[key]
        ctr["env"] = [*(ctr.get("env") or []), *(trainer.get("env") or [])]
    pet = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
           "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
    return _jobset_pods(jobset, ns, start, lambda i: {**pet, "PET_NODE_RANK": str(i)})


def _pod(podspec: dict[str, Any], host: str, aliases: list[str], index: int,
         fields: dict[str, str], extra_env: dict[str, str] | None = None) -> LocalPod:
    ctr = podspec["containers"][0]
    address = pod_address(index)
    env: dict[str, str] = {}
    for item in ctr.get("env") or []:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        else:
            env[item["name"]] = _field(item["valueFrom"], host, address, fields)
    env |= extra_env or {}
    argv = tuple(expand(a, env) for a in [*(ctr.get("command") or []), *(ctr.get("args") or [])])
    volumes = {v["name"]: v for v in podspec.get("volumes") or []}
    return LocalPod(host, host, (*aliases, host), address, argv, env, ctr.get("workingDir"),
                    tuple(ctr.get("volumeMounts") or []), volumes)


def _field(source: dict[str, Any], host: str, address: str, fields: dict[str, str]) -> str:
    path = (source.get("fieldRef") or {}).get("fieldPath", "")
    if path == "metadata.annotations['batch.kubernetes.io/job-completion-index']":
        return fields["index"]
    if path == "metadata.name":
        return host
    if path == "status.podIP":
        return address
    raise LocalRunError(f"run-local cannot emulate env valueFrom {source}")
