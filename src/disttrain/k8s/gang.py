"""All pods or none: the Kueue queue label and the Coscheduling PodGroup of a multi-pod job.

    queue_labels(spec.cluster)              # {'kueue.x-k8s.io/queue-name': 'team-a'} or {}
    pod_group(spec, labels)                 # the scheduler-plugins PodGroup (gang: coscheduling)
    no_gang_note(spec)                      # the one line a multi-pod render without either gets

hami-scheduler places pods one at a time. A 2-pod job on a cluster with one free slice
starts one pod, whose ranks hold their GPU memory in the rendezvous until it times out;
two such jobs can hold each other's slices forever (Kueue's docs, "Setup
waitForPodsReady"; kubeflow/trainer#1825). Two ways out that work with hami-scheduler
(docs/cluster.md, "All pods or none"):

- Kueue admits the whole job or none of it by quota and never touches `schedulerName`,
  so hami-scheduler still places the pods; the queue is a label on the workload object.
- scheduler-plugins Coscheduling holds every pod of a PodGroup in the Permit phase until
  `minMember` of them fit; HAMi >= 2.10 cooperates with it (its Bind retries the node lock
  for pod-group members, HAMi pkg/util/util.go IsPodGroupMember). The group is the
  PodGroup object plus the `scheduling.x-k8s.io/pod-group` label on every pod.

A TrainJob gets its PodGroup from Kubeflow Trainer itself (the runtime's
`podGroupPolicy.coscheduling`), so none is rendered for it here.
"""

from __future__ import annotations

from typing import Any

from disttrain.errors import SpecError
from disttrain.spec.cluster import ClusterSpec
from disttrain.spec.job import JobSpec

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # HAMi pkg/util/types.go PodGroupLabel
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"


def pod_count(spec: JobSpec) -> int:
    """How many pods the job's workload creates (one per node)."""
    return 1 if spec.cluster.kind == "pod" else spec.launch.nnodes


def check(spec: JobSpec) -> None:
    """Refuse a gang option that cannot apply.

    Raises:
        SpecError: naming the field and the fix.
    """
    c = spec.cluster
    if c.gang and pod_count(spec) < 2:
        raise SpecError("cluster.gang: a 1-pod job starts whole or not at all already; "
                        "drop --gang (or use --nnodes 2 or more)")
    # against the default, not model_fields_set: a spec passed on as model_dump() (the
    # verify runner, the ranks) has every field "set"
    if c.gang_timeout_s != type(c).model_fields["gang_timeout_s"].default and not c.gang:
        raise SpecError("cluster.gang_timeout_s: it is the PodGroup's scheduleTimeoutSeconds "
                        "of --gang coscheduling, which is not set; add --gang coscheduling "
                        "or drop it")
    if c.gang and c.elastic_nodes:
        raise SpecError("cluster.gang: an elastic PyTorchJob runs with any node count in "
                        "cluster.elastic_nodes, so a fixed minMember would be wrong; drop "
                        "--gang or --elastic-nodes")


def queue_labels(cluster: ClusterSpec) -> dict[str, str]:
    """The Kueue label for the workload object (Kueue reads it there, not on pods)."""
    return {KUEUE_QUEUE_LABEL: cluster.queue} if cluster.queue else {}


def renders_pod_group(spec: JobSpec) -> bool:
    """Does disttrain render a PodGroup (not for a TrainJob: Trainer makes its own)?"""
    return spec.cluster.gang == "coscheduling" and spec.cluster.kind != "trainjob"


def pod_group_labels(spec: JobSpec) -> dict[str, str]:
    """The label that makes a pod a member of the job's PodGroup (every pod template)."""
    return {POD_GROUP_LABEL: spec.name} if renders_pod_group(spec) else {}


def pod_group(spec: JobSpec, labels: dict[str, str]) -> dict[str, Any]:
    """The scheduler-plugins PodGroup: minMember = the pods of the job."""
    return {"apiVersion": POD_GROUP_API, "kind": "PodGroup",
            "metadata": {"name": spec.name, "namespace": spec.cluster.namespace,
                         "labels": labels},
            "spec": {"minMember": pod_count(spec),
                     "scheduleTimeoutSeconds": spec.cluster.gang_timeout_s}}


def no_gang_note(spec: JobSpec) -> str | None:
    """One line for a multi-pod job with neither a queue nor a gang, else None."""
    n = pod_count(spec)
    if n < 2 or spec.cluster.queue or spec.cluster.gang:
        return None
    return (f"cluster.gang: the {n} pods are placed one at a time, so some can start while "
            f"others wait for GPU room and hold their slices until the rendezvous deadline "
            f"(two such jobs can block each other); --gang coscheduling or --queue NAME "
            f"(Kueue) starts all pods or none (docs/cluster.md, \"All pods or none\")")
