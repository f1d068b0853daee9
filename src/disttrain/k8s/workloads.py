"""The multi-pod workload objects of a render: Indexed Job + Service, PyTorchJob, JobSet and
Kubeflow Trainer v2 TrainJob (with its ClusterTrainingRuntime).

    objects = workload_objects(renderer)    # render.py's _Renderer, after its checks

Each builder takes the renderer for the pieces every kind shares (container, pod spec,
pod metadata, env) and adds what its kind needs (docs/cluster.md, "The kinds"):

- `job`: pods `<job>-<i>`, torchrun with c10d rendezvous at pod 0's stable DNS name
  `<job>-0.<svc>`; the headless Service is rendered here.
- `pytorchjob`: the training operator injects PET_* (static rendezvous at the master).
- `jobset` (jobset.x-k8s.io/v1alpha2, JobSet v0.12): one replicated Job of nnodes pods,
  `<job>-node-0-<i>.<job>` (JobSet's own headless Service); its failurePolicy recreates
  *all* pods when one fails (a rank lost from a DDP group cannot rejoin it alone), up to
  launch.max_restarts times. Same c10d argv as `job`.
- `trainjob` (trainer.kubeflow.org/v1alpha1, Trainer v2.3): a TrainJob cannot set
  `schedulerName`, volumes or `/dev/shm` (its runtimePatches have none of the first), so
  each job gets a ClusterTrainingRuntime `<job>.<namespace>` holding the pod template
  (hami-scheduler, volumes, shm, security context, and `podGroupPolicy.coscheduling` for
  --gang); the TrainJob names it in runtimeRef and carries command, env and resources.
  Trainer's torch plugin injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and
  PET_MASTER_ADDR `<job>-node-0-0.<job>`, PET_MASTER_PORT 29500 (pkg/runtime/framework/
  plugins/torch/torch.go), so torchrun runs a static rendezvous there, as under a PyTorchJob.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from disttrain import envvars
from disttrain.k8s import gang
from disttrain.k8s.labels import ANNOTATION_RANK_OFFSET, LABEL_JOB, LABEL_KIND
from disttrain.k8s.stopping import pod_failure_policy
from disttrain.launch.argv import rdzv_timeout_s, torchrun_argv, worker_command

if TYPE_CHECKING:
    from disttrain.k8s.render import _Renderer

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_PORT = 29500  # Trainer's constants.ContainerTrainerPort: PET_MASTER_PORT, fixed
REPLICATED_JOB = "node"  # the replicated Job's name and (Trainer) the container's name


def runtime_name(name: str, namespace: str) -> str:
    """The job's ClusterTrainingRuntime (cluster-scoped: the namespace keeps names apart)."""
    return f"{name}.{namespace}"


def pod_hosts(name: str, kind: str, n: int) -> list[str]:
    """JobSet pod hostnames `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`."""
    assert kind in ("jobset", "trainjob")
    return [f"{name}-{REPLICATED_JOB}-0-{i}" for i in range(n)]


def workload_objects(r: _Renderer) -> list[dict[str, Any]]:
    """The workload (and its Service or runtime) for the multi-pod kinds."""
    kind = r.c.kind
    if kind == "job":
        return [service(r), job(r)]
    if kind == "pytorchjob":
        return [pytorchjob(r)]
    if kind == "jobset":
        return [jobset(r)]
    return trainjob(r)


def _meta(r: _Renderer, name: str) -> dict[str, Any]:
    """The workload object's metadata: the queue label goes there (Kueue reads it there)."""
    meta = r._meta(name)
    meta["labels"].update(gang.queue_labels(r.c))
    return meta


def _pod_meta(r: _Renderer) -> dict[str, Any]:
    meta = r._pod_meta()
    meta["labels"].update(gang.pod_group_labels(r.spec))
    return meta


def _indexed_env(r: _Renderer, rank0: str) -> list[tuple[str, Any]]:
    env: list[tuple[str, Any]] = [
        (envvars.MASTER_ADDR, rank0), (envvars.MASTER_PORT, str(r.port)),
        ("JOB_COMPLETION_INDEX", {"fieldRef": {"fieldPath": "metadata.annotations"
                                  "['batch.kubernetes.io/job-completion-index']"}})]
    if r.spec.launch.max_restarts:  # a re-created pod's agent must rejoin (envvars.py)
        env.append((envvars.SHARE_RDZV_STORE_OFF, "1"))
    return env


def _c10d_container(r: _Renderer, rank0: str) -> dict[str, Any]:
    argv = torchrun_argv(r._pod_spec_view(), nproc=r.nproc, node_rank="$(JOB_COMPLETION_INDEX)",
                         rdzv_endpoint=f"{rank0}:{r.port}", spec_path=r._spec_path(),
                         script_entry=r._script_entry())
    return r._container("trainer", argv, _indexed_env(r, rank0))


def _static_argv(r: _Renderer, restarts: bool) -> list[str]:
    """torchrun reading PET_* from the operator: static rendezvous at the master, whose
    TCPStore waits `timeout` seconds for the other nodes (torch's default 600)."""
    argv = ["torchrun", f"--nproc_per_node={r.nproc}"]
    deadline = rdzv_timeout_s(r.spec)
    if deadline is not None:
        argv.append(f"--rdzv_conf=timeout={deadline}")
    if restarts and r.spec.launch.max_restarts:
        argv.append(f"--max_restarts={r.spec.launch.max_restarts}")
    return argv + worker_command(r._pod_spec_view(), r._spec_path(), r._script_entry())


# -- job -------------------------------------------------------------------------------
def service(r: _Renderer) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": r._meta(r.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: r.name, LABEL_KIND: "job"},
                     "ports": [{"name": "rdzv", "port": r.port,
                                "targetPort": r.port, "protocol": "TCP"}]}}


def job(r: _Renderer) -> dict[str, Any]:
    n = r.spec.launch.nnodes
    rank0 = f"{r.name}-0.{r.name}"  # pod 0's hostname.subdomain
    podspec = r._podspec(_c10d_container(r, rank0), subdomain=r.name)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(r, r.name),
            "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n,
                     # one lost rank breaks the process group: without restarts the
                     # Job fails at once; with them, a failed pod is re-created and
                     # torchrun re-forms the group from the last checkpoint
                     "backoffLimit": r.spec.launch.max_restarts,
                     # a preempted or stopped (75) pod is recreated, uncounted (stopping.py)
                     "podFailurePolicy": pod_failure_policy("trainer"),
                     "template": {"metadata": _pod_meta(r), "spec": podspec}}}


# -- pytorchjob ------------------------------------------------------------------------
def pytorchjob(r: _Renderer) -> dict[str, Any]:
    n, c = r.spec.launch.nnodes, r.c
    argv = _static_argv(r, restarts=not c.elastic_nodes)
    if c.elastic_nodes:  # c10d from PET_RDZV_*: its deadline is rdzvConf's join_timeout
        argv = [a for a in argv if not a.startswith("--rdzv_conf=")]
    ctr = r._container("pytorch", argv, [], unbuffered=False)  # the operator sets it
    ctr["ports"] = [{"name": "pytorchjob-port", "containerPort": r.port, "protocol": "TCP"}]
    podspec = r._podspec(ctr)

    def replica(count: int, rank_offset: int = 0) -> dict[str, Any]:
        meta = _pod_meta(r)
        if rank_offset:
            meta["annotations"][ANNOTATION_RANK_OFFSET] = str(rank_offset)
        policy = "OnFailure" if r.spec.launch.max_restarts and not c.elastic_nodes else "Never"
        return {"replicas": count, "restartPolicy": policy,
                "template": {"metadata": meta, "spec": copy.deepcopy(podspec)}}

    spec: dict[str, Any] = {"nprocPerNode": str(r.nproc),
                            "runPolicy": {"cleanPodPolicy": "None",
                                          "backoffLimit": r.spec.launch.max_restarts}}
    if c.elastic_nodes:
        lo, hi = (int(x) for x in c.elastic_nodes.split(":"))
        spec["elasticPolicy"] = {"minReplicas": lo, "maxReplicas": hi, "rdzvBackend": "c10d",
                                 "rdzvId": r.spec.launch.rdzv_id or r.name,
                                 "maxRestarts": r.spec.launch.max_restarts}
        deadline = rdzv_timeout_s(r.spec)
        if deadline is not None:
            spec["elasticPolicy"]["rdzvConf"] = [{"key": "join_timeout",
                                                  "value": str(deadline)}]
        spec["pytorchReplicaSpecs"] = {"Worker": replica(n)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
        if n > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replica(n - 1, rank_offset=1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": _meta(r, r.name), "spec": spec}


# -- jobset ----------------------------------------------------------------------------
def _indexed_job_template(r: _Renderer, podspec: dict[str, Any],
                          labels: dict[str, str]) -> dict[str, Any]:
    """A replicated Job: any failed pod fails it (backoffLimit 0) and JobSet then
    recreates every pod; a stopped or disrupted pod is recreated alone (stopping.py)."""
    n = r.spec.launch.nnodes
    return {"metadata": {"labels": labels},
            "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n,
                     "backoffLimit": 0, "podFailurePolicy": pod_failure_policy(
                         podspec["containers"][0]["name"]),
                     "template": {"metadata": _pod_meta(r), "spec": podspec}}}


def jobset(r: _Renderer) -> dict[str, Any]:
    rank0 = f"{pod_hosts(r.name, 'jobset', 1)[0]}.{r.name}"
    podspec = r._podspec(_c10d_container(r, rank0))
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _meta(r, r.name),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": r.spec.launch.max_restarts},
                     "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                         "template": _indexed_job_template(
                                             r, podspec, r._labels())}]}}


# -- trainjob --------------------------------------------------------------------------
def trainjob(r: _Renderer) -> list[dict[str, Any]]:
    argv = _static_argv(r, restarts=False)  # JobSet recreates all pods (failurePolicy)
    ctr = r._container(REPLICATED_JOB, argv, [])
    trainer: dict[str, Any] = {"image": ctr["image"], "numNodes": r.spec.launch.nnodes,
                               "numProcPerNode": r.nproc}
    for key, field in (("command", "command"), ("args", "args"), ("env", "env"),
                       ("resources", "resourcesPerNode")):
        if key in ctr:  # the TrainJob's trainer fields replace the runtime's container ones
            trainer[field] = ctr.pop(key)
    ctr["ports"] = [{"containerPort": TRAINER_PORT, "protocol": "TCP"}]
    podspec = r._podspec(ctr)
    labels = {**r._labels(), "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    template = _indexed_job_template(r, podspec, labels)
    for key in ("completions", "parallelism"):  # Trainer sets them from numNodes
        template["spec"].pop(key)
    spec: dict[str, Any] = {
        "mlPolicy": {"numNodes": r.spec.launch.nnodes, "torch": {}},
        "template": {"spec": {"failurePolicy": {"maxRestarts": r.spec.launch.max_restarts},
                              "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                                  "template": template}]}}}
    if r.c.gang == "coscheduling":
        spec["podGroupPolicy"] = {"coscheduling": {
            "scheduleTimeoutSeconds": r.c.gang_timeout_s}}
    name = runtime_name(r.name, r.c.namespace)
    meta = r._meta(name)
    del meta["namespace"]  # cluster-scoped
    runtime = {"apiVersion": TRAINER_API, "kind": "ClusterTrainingRuntime", "metadata": meta,
               "spec": spec}
    train = {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": _meta(r, r.name),
             "spec": {"runtimeRef": {"name": name, "apiGroup": "trainer.kubeflow.org",
                                     "kind": "ClusterTrainingRuntime"},
                      "trainer": trainer}}
    return [runtime, train]
