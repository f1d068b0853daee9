"""The parallelism mesh on pods x processes (issue 26 item 6): tp within a pod, pp across
pods; a tp that would span pods refused with the reason; the layout written on every kind's
pods (schema-valid), the degrees in the job.yaml the pods' command reads; the warnings about
what HAMi's NCCL workarounds cost a tp job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import validate_all
from disttrain.errors import SpecError
from disttrain.k8s.mesh_layout import ANNOTATION_MESH, mesh_layout, place
from disttrain.k8s.render import render
from disttrain.k8s.workloads import TRAINER_PORT
from disttrain.spec.job import JobSpec
from disttrain.spec.parallelism import Degrees

IMG = "registry.local:30000/ml/train:1"
TASK = "disttrain.examples.chargpt:make_task"


def _spec(parallelism: dict[str, Any], nnodes: int = 1, nproc: int | str = 2, port: int = 29500,
          **cluster: Any) -> JobSpec:
    return JobSpec.from_dict({
        "task": TASK, "parallelism": parallelism,
        "launch": {"nnodes": nnodes, "nproc_per_node": nproc, "master_port": port},
        "cluster": {"image": IMG, "image_has_disttrain": True, "gpus": 2, "gpumem": 8000,
                    **cluster}})


# -- where each dimension lands ----------------------------------------------------------------
@pytest.mark.parametrize("degrees, pods, nproc, across", [
    (Degrees(pp=2, dp_replicate=1, dp_shard=1, tp=2), 2, 2, ("pp",)),   # stage = pod, tp inside
    (Degrees(pp=4, dp_replicate=1, dp_shard=1, tp=1), 2, 2, ("pp",)),   # two stages per pod
    (Degrees(pp=2, dp_replicate=1, dp_shard=1, tp=1), 1, 2, ()),        # one pod: all inside
    (Degrees(pp=2, dp_replicate=1, dp_shard=2, tp=2), 2, 4, ("pp",)),   # dp x tp inside a pod
    (Degrees(pp=1, dp_replicate=1, dp_shard=2, tp=2), 2, 2, ("dp_shard",)),  # dp over pods
])
def test_tp_lands_within_a_pod_and_pp_across_pods(degrees, pods, nproc, across):
    layout = place(degrees, pods, nproc)
    assert layout.across_pods == across
    assert "tp" not in layout.across_pods


def test_the_layout_says_which_dimension_is_where():
    text = place(Degrees(2, 1, 1, 2), 2, 2).describe()
    assert text == ("pp=2 x dp_replicate=1 x dp_shard=1 x tp=2 on 2 pods x 2 processes: "
                    "across pods: pp; within each pod: tp")


def test_a_tp_that_would_span_pods_is_refused_with_the_reason():
    with pytest.raises(SpecError, match=r"parallelism\.tp: 4 does not divide "
                                        r"launch\.nproc_per_node 2: a tensor-parallel group must "
                                        r"sit within one pod") as err:
        place(Degrees(1, 1, 1, 4), 2, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match=r"parallelism\.tp: 4 does not divide"):
        render(_spec({"tp": 4}, nnodes=2, kind="job"), ".")
    # elastic pods: the world is resolved in the ranks, but tp-in-a-pod is known now
    with pytest.raises(SpecError, match=r"parallelism\.tp: 4 does not divide"):
        render(_spec({"tp": 4}, nnodes=2, kind="pytorchjob", elastic_nodes="1:2"), ".")


def test_plain_data_parallel_has_no_layout():
    assert mesh_layout(_spec({}), 2) is None


# -- every kind ------------------------------------------------------------------------------
KINDS = {  # kind -> (nnodes, parallelism, what the annotation says)
    "pod": (1, {"tp": 2}, "tp=2 on 1 pod x 2 processes: within each pod: tp"),
    "job": (2, {"pp": 4}, "pp=4 x dp_replicate=1 x dp_shard=1 x tp=1 on 2 pods x 2 processes: "
                          "across pods: pp"),
    "pytorchjob": (2, {"pp": 4}, "across pods: pp"),
    "jobset": (2, {"pp": 4}, "across pods: pp"),
    "trainjob": (2, {"pp": 4}, "across pods: pp"),
}


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod metadata in a rendered object (Pod, Job, PyTorchJob, JobSet, TrainJob)."""
    found: list[dict[str, Any]] = []

    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            if key == "template" and "spec" in node and "containers" in node["spec"]:
                found.append(node.get("metadata", {}))
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)

    if obj["kind"] == "Pod":
        return [obj["metadata"]]
    walk(obj)
    return found


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_renders_the_mesh_schema_valid(kind: str, workdir: Path):
    nnodes, parallelism, says = KINDS[kind]
    spec = _spec(parallelism, nnodes=nnodes, port=TRAINER_PORT if kind == "trainjob" else 29500,
                 kind=kind)
    rendered = render(spec, workdir)
    validate_all(rendered.objects)
    annotations = [m.get("annotations", {}).get(ANNOTATION_MESH) for o in rendered.objects
                   for m in _pod_templates(o)]
    assert annotations and all(a is not None and says in a for a in annotations), annotations
    # the degrees reach the ranks in job.yaml, which the rendered command reads (--spec)
    cm = next(o for o in rendered.objects if o["kind"] == "ConfigMap")
    job = yaml.safe_load(cm["data"]["job.yaml"])
    assert {k: job["parallelism"][k] for k in parallelism} == parallelism
    text = yaml.safe_dump(rendered.objects)
    assert "/etc/disttrain/job.yaml" in text and "--spec" in text


# -- NCCL under HAMi -------------------------------------------------------------------------
def test_tp_with_the_slow_nccl_workarounds_or_no_shm_is_warned(workdir: Path):
    quiet = render(_spec({"tp": 2}), workdir).warnings
    assert not any("parallelism.tp" in w or "cluster.shm: tp" in w for w in quiet)
    slow = render(_spec({"tp": 2}, vgpu_workarounds=["no-p2p"]), workdir).warnings
    assert any(w.startswith("parallelism.tp: 2 with no-p2p") and "--pp" in w for w in slow)
    no_shm = render(_spec({"tp": 2}, shm=None), workdir).warnings
    assert any(w.startswith("cluster.shm: tp=2") and "ncclShmOpen" in w for w in no_shm)
    # pp alone sends one activation per micro-batch: nothing to warn about
    assert not any("parallelism" in w for w in render(_spec({"pp": 2}, shm=None), workdir).warnings)


def test_render_cli_refuses_a_tp_across_pods_in_one_line(cli: Any, workdir: Path):
    result = cli("k8s", "render", "--example", "chargpt", "--image", IMG, "--image-has-disttrain",
                 "--kind", "job", "--nnodes", "2", "--nproc-per-node", "2", "--gpus", "2",
                 "--tp", "4", "--master-port", "29500", "--no-plan")
    assert result.code == 2, result.err
    assert len(result.error_lines) == 1, result.err
    assert "parallelism.tp: 4 does not divide launch.nproc_per_node 2" in result.error_lines[0]
    assert result.out == ""
