"""The labels and annotations disttrain puts on the objects it renders.

    selector = f"{LABEL_JOB}={name}"        # how client.py finds a job's pods again

One module for the keys, because two sides must agree on them: render.py writes them,
client.py and output.py read them back (a job's pods by LABEL_JOB, a Worker's node rank by
ANNOTATION_RANK_OFFSET). Changing a value here orphans the objects of jobs already applied,
which the client then no longer finds or owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.spec.job import JobSpec

LABEL_JOB = "disttrain.io/job"  # the job's name on every object: what status/logs/delete select
LABEL_KIND = "disttrain.io/kind"  # pod | job | pytorchjob | jobset | trainjob
LABEL_WORKLOAD = "disttrain.io/workload"  # the job's kind: "task" or "script"
LABEL_NEEDS_DISTTRAIN = "disttrain.io/needs-disttrain"  # "true" when the pod runs disttrain.worker
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

ANNOTATION_IMAGE = "disttrain.io/image-needs"  # what the image must hold; heads the YAML output
ANNOTATION_CODE = "disttrain.io/code-sha256"  # code ConfigMap's hash: new code, new pod
ANNOTATION_FILES = "disttrain.io/code-files"  # what the code ConfigMap ships; heads its YAML
ANNOTATION_RANK_OFFSET = "disttrain.io/rank-offset"  # node rank of replica-index 0 (Worker after Master)
ANNOTATION_RENDER_HASH = "disttrain.io/render-hash"  # the rendered form, for an idempotent apply

# label keys a user's cluster.labels may not set: disttrain finds its objects by them
RESERVED_PREFIXES = ("disttrain.io/", "app.kubernetes.io/")


def pod_name_hosts(spec: JobSpec) -> list[str]:
    """Hostnames of the pods of `spec`, in node-rank order (what the DNS names point to):
    the names the renderer gives the pods, which run-local and the messages naming a lost
    host use too."""
    name, kind, n = spec.name, spec.cluster.kind, spec.launch.nnodes
    if kind == "pod":
        return [name]
    if kind == "job":
        return [f"{name}-{i}" for i in range(n)]
    if kind in ("jobset", "trainjob"):  # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>
        return [f"{name}-node-0-{i}" for i in range(n)]
    if spec.cluster.elastic_nodes:
        return [f"{name}-worker-{i}" for i in range(n)]
    return [f"{name}-master-0"] + [f"{name}-worker-{i}" for i in range(n - 1)]
