"""All pods or none (issue 24): every kind × gang option rendered and validated against the
pinned CRDs and the Kubernetes schemas; the apply/delete round trip of the gang objects
through the fake API server; the free-slice check from HAMi's own annotation formats; the
Pending reasons and the rendezvous verdict; the JobSet and TrainJob pods as run-local
emulates them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from k8s_fake_apiserver import FakeApiServer

from conftest import gang_crd_schema, validate_all
from disttrain.errors import LocalRunError, SpecError
from disttrain.k8s import capacity, local, pending
from disttrain.k8s.gang import KUEUE_QUEUE_LABEL, POD_GROUP_LABEL
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec

IMG = "registry.local/ml/train:1"
KINDS = ("pod", "job", "pytorchjob", "jobset", "trainjob")
GANGS: dict[str, dict[str, Any]] = {"none": {}, "queue": {"queue": "team-a"},
                                    "coscheduling": {"gang": "coscheduling",
                                                     "gang_timeout_s": 120}}
WORKLOAD_KINDS = {"pod": "Pod", "job": "Job", "pytorchjob": "PyTorchJob", "jobset": "JobSet",
                  "trainjob": "TrainJob"}


def _spec(kind: str, gang: str = "none", nnodes: int = 2, launch: dict[str, Any] | None = None,
          **cluster: Any) -> JobSpec:
    return JobSpec.from_dict({
        "name": "ddp", "script": "train.py",
        "launch": {"nnodes": 1 if kind == "pod" else nnodes, "nproc_per_node": 2,
                   **(launch or {})},
        "cluster": {"kind": kind, "image": IMG, "gpus": 2, "gpumem": 12000, "gpucores": 30,
                    "volumes": [{"name": "models", "pvc": "nfs-modelscope", "mount": "/models",
                                 "read_only": True},
                                {"name": "data", "pvc": "nfs-training-data", "mount": "/data"}],
                    **GANGS[gang], **cluster}})


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    kind, spec = obj["kind"], obj.get("spec") or {}
    if kind == "Job":
        return [spec["template"]]
    if kind == "PyTorchJob":
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    if kind == "JobSet":
        return [r["template"]["spec"]["template"] for r in spec["replicatedJobs"]]
    if kind == "ClusterTrainingRuntime":
        return [r["template"]["spec"]["template"] for r in spec["template"]["spec"]["replicatedJobs"]]
    return []


@pytest.mark.parametrize("gang", sorted(GANGS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_and_gang_option_renders_valid_objects(kind: str, gang: str,
                                                          workdir: Path) -> None:
    if kind == "pod" and gang == "coscheduling":
        with pytest.raises(SpecError, match=r"cluster\.gang: a 1-pod job"):
            render(_spec(kind, gang), workdir)
        return
    rendered = render(_spec(kind, gang), workdir)
    objects = rendered.objects
    validate_all(objects)  # pinned CRDs (JobSet, PodGroup, TrainJob, runtime) + k8s strict
    by_kind = {o["kind"]: o for o in objects}
    workload = by_kind[WORKLOAD_KINDS[kind]]
    labels = workload["metadata"]["labels"]
    assert (labels.get(KUEUE_QUEUE_LABEL) == "team-a") == (gang == "queue")
    templates = [t for o in objects for t in _pod_templates(o)]
    own_group = gang == "coscheduling" and kind != "trainjob"
    if own_group:  # the PodGroup comes before everything that makes pods
        assert objects[0]["kind"] == "PodGroup"
        assert objects[0]["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
        assert all(t["metadata"]["labels"][POD_GROUP_LABEL] == "ddp" for t in templates)
    else:
        assert "PodGroup" not in by_kind
        assert all(POD_GROUP_LABEL not in t["metadata"]["labels"] for t in templates)
    half_start = [w for w in rendered.warnings if w.startswith("cluster.gang:")]
    assert len(half_start) == (1 if gang == "none" and kind != "pod" else 0)
    if half_start:
        assert "--gang coscheduling or --queue NAME" in half_start[0]


def test_a_jobset_restarts_all_ranks_and_uses_its_own_service(workdir: Path) -> None:
    objects = render(_spec("jobset", launch={"max_restarts": 2}), workdir).objects
    assert [o["kind"] for o in objects] == ["ConfigMap", "JobSet"]  # no Service of ours
    js = objects[-1]
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 2}
    (rjob,) = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert (rjob["replicas"], job["completions"], job["parallelism"], job["backoffLimit"]) == \
        (1, 2, 2, 0)  # any failed pod fails the Job, and JobSet recreates every pod
    args = job["template"]["spec"]["containers"][0]["args"]
    assert "--rdzv_endpoint=ddp-node-0-0.ddp:29500" in args
    assert "--rdzv_conf=join_timeout=180" in args


def test_a_trainjob_gets_a_runtime_for_hami(workdir: Path) -> None:
    objects = render(_spec("trainjob", "coscheduling", runtime_class="nvidia",
                           shm="4Gi"), workdir).objects
    runtime = next(o for o in objects if o["kind"] == "ClusterTrainingRuntime")
    train = objects[-1]
    assert objects.index(runtime) < objects.index(train)
    assert "namespace" not in runtime["metadata"] and runtime["metadata"]["name"] == "ddp.default"
    assert train["spec"]["runtimeRef"] == {"name": "ddp.default",
                                           "apiGroup": "trainer.kubeflow.org",
                                           "kind": "ClusterTrainingRuntime"}
    assert runtime["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 120}}
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]
    assert pod["schedulerName"] == "hami-scheduler" and pod["runtimeClassName"] == "nvidia"
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/dev/shm", "/models", "/data"} <= mounts
    assert pod["containers"][0]["name"] == "node"  # Trainer's torch plugin looks for it
    trainer = train["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 2
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpumem"] == "12000"
    assert "--rdzv_conf=timeout=180" in trainer["args"]  # static: PET_* from Trainer


@pytest.mark.parametrize("kind,broken", [
    ("jobset", lambda o: o["spec"].update(failurePolicy={"maxRestart": 1})),
    ("trainjob", lambda o: o["spec"]["trainer"].update(numNodes="two")),
])
def test_the_pinned_crds_catch_a_wrong_field(kind: str, broken: Any, workdir: Path) -> None:
    obj = copy.deepcopy(render(_spec(kind), workdir).objects[-1])
    broken(obj)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, gang_crd_schema(obj["kind"]))


def test_a_podgroup_of_zero_pods_is_invalid() -> None:
    group = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
             "metadata": {"name": "x"}, "spec": {"minMember": 0}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(group, gang_crd_schema("PodGroup"))


@pytest.mark.parametrize("flags,message", [
    (["--kind", "job", "--nnodes", "1", "--gang", "coscheduling"], "cluster.gang: a 1-pod job"),
    (["--kind", "pytorchjob", "--nnodes", "2", "--elastic-nodes", "1:3", "--gang",
      "coscheduling"], "cluster.gang: an elastic PyTorchJob"),
    (["--kind", "trainjob", "--nnodes", "2", "--master-port", "23456"],
     "launch.master_port: Kubeflow Trainer fixes"),
    (["--kind", "job", "--nnodes", "2", "--queue", "Team_A"], "cluster.queue"),
    (["--kind", "job", "--nnodes", "2", "--gang", "volcano"], "'--gang'"),
    (["--kind", "job", "--nnodes", "2", "--rdzv-timeout-s", "0"], "launch.rdzv_timeout_s"),
    (["--kind", "job", "--nnodes", "1", "--rdzv-timeout-s", "60"],
     "launch.rdzv_timeout_s: one node has no rendezvous"),
    (["--kind", "jobset", "--nnodes", "2", "--gang-timeout-s", "60"],
     "cluster.gang_timeout_s: it is the PodGroup's"),
])
def test_gang_options_that_cannot_apply_are_refused(flags: list[str], message: str, cli: Any,
                                                    workdir: Path) -> None:
    result = cli("k8s", "render", "train.py", "--image", IMG, *flags)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err
    assert result.out == ""


# -- HAMi's books ------------------------------------------------------------------------
UUID = "GPU-{:08x}-207a-2038-9b45-23cac89cb67d"
RTX = "NVIDIA-NVIDIA GeForce RTX 3090"


def _register(uuids: list[str], legacy: bool) -> str:
    """hami.io/node-nvidia-register as HAMi writes it: JSON (>= v2.8, MarshalNodeDevices,
    omitempty drops numa/index 0) or the older `id,count,devmem,devcore,type,numa,health:`."""
    if legacy:
        return "".join(f"{u},10,24576,100,{RTX},0,true:" for u in uuids)
    return json.dumps([{"id": u, "count": 10, "devmem": 24576, "devcore": 100, "type": RTX,
                        "health": True, "mode": "hami-core", **({"index": i} if i else {})}
                       for i, u in enumerate(uuids)])


def _node(name: str, uuids: list[str], legacy: bool = False) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name},
                         "annotations": {"hami.io/node-nvidia-register":
                                         _register(uuids, legacy)}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def _user_pod(name: str, devices: list[tuple[str, int, int]], phase: str = "Running",
              namespace: str = "other") -> dict[str, Any]:
    """A pod hami-scheduler bound: `uuid,type,usedmem,usedcores:` per GPU, `;` per container."""
    allocated = "".join(f"{u},NVIDIA,{mem},{cores}:" for u, mem, cores in devices) + ";"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "annotations": {"hami.io/vgpu-devices-allocated": allocated,
                                         "hami.io/vgpu-node": "10-60-18-8"}},
            "spec": {"nodeName": "10-60-18-8", "containers": [{"name": "c"}]},
            "status": {"phase": phase}}


A, B, C, D = (UUID.format(i) for i in range(4))
BUSY = [_user_pod("a1", [(A, 12000, 30)]), _user_pod("a2", [(A, 12000, 30)]),
        _user_pod("b1", [(B, 12000, 30)])]


@pytest.mark.parametrize("legacy", [False, True], ids=["json-v2.8+", "colon-before-v2.8"])
def test_both_node_encodings_read_the_same(legacy: bool) -> None:
    gpus = capacity.parse_node_devices(_register([A, B], legacy), "n")
    assert [(g.uuid, g.count, g.devmem, g.devcore, g.type, g.health) for g in gpus] == \
        [(A, 10, 24576, 100, RTX, True), (B, 10, 24576, 100, RTX, True)]
    nine = f"{A},10,24576,100,{RTX},0,true,0,hami-core:"  # the 9-field form of the old one
    assert capacity.parse_node_devices(nine, "n")[0].devmem == 24576


def test_pod_allocations_of_several_containers_and_gpus() -> None:
    text = f"{A},NVIDIA,12000,30:{B},NVIDIA,8000,0:;;{C},NVIDIA,100,10:;"
    assert capacity.parse_pod_devices(text) == [(A, 12000, 30), (B, 8000, 0), (C, 100, 10)]


@pytest.mark.parametrize("legacy", [False, True], ids=["json-v2.8+", "colon-before-v2.8"])
def test_a_gang_that_does_not_fit_is_refused_with_the_numbers(legacy: bool) -> None:
    spec = _spec("job")  # 2 pods × 2 GPUs × 12000 MiB, 30 % cores
    fit = capacity.gang_fit(spec, [_node("10-60-18-8", [A, B], legacy)], BUSY)
    assert not fit.fits
    assert fit.message.startswith("needs 2 pods × 2 slices of 12000 MiB and 30% cores; "
                                  "free now: node 10-60-18-8: 1 slice (room for 0 of the 2")
    # finished pods hold nothing; a second node gives the other pod its two GPUs
    done = [_user_pod(p["metadata"]["name"], [], "Succeeded") for p in BUSY]
    assert capacity.gang_fit(spec, [_node("10-60-18-8", [A, B], legacy)], done).fits
    two_nodes = [_node("10-60-18-8", [A, B], legacy), _node("10-60-18-9", [C, D], legacy)]
    assert capacity.gang_fit(spec, two_nodes, BUSY).fits  # 2 slices of 12000 per 24 GiB GPU
    fit = capacity.gang_fit(_spec("job", gpumem=16000), two_nodes, BUSY)  # 1 slice per GPU
    assert not fit.fits
    assert fit.message.endswith("free now: node 10-60-18-8: 0 slices, node 10-60-18-9: "
                                "2 slices (room for 1 of the 2 pods)")
    # 3 free slices, but a pod's 2 GPUs must be distinct cards (HAMi Fit): A, A, B hold one
    fit = capacity.gang_fit(spec, [_node("10-60-18-8", [A, B], legacy)],
                            [_user_pod("b1", [(B, 12000, 30)])])
    assert not fit.fits
    assert fit.message.endswith("node 10-60-18-8: 3 slices (room for 1 of the 2 pods)")


def test_the_check_follows_hamis_fit_rules() -> None:
    one = [_node("n1", [A])]
    exclusive = _spec("job", nnodes=2, gpumem=None, gpucores=None, gpus=1)  # whole cards
    assert not capacity.gang_fit(exclusive, [_node("n1", [A, B])],
                                 [_user_pod("x", [(A, 1000, 10)])]).fits  # A is in use
    assert capacity.gang_fit(exclusive, [_node("n1", [A, B, C])],
                             [_user_pod("x", [(A, 1000, 10)])]).fits
    full_cores = [_user_pod("x", [(A, 1000, 100)])]
    zero_cores = _spec("job", nnodes=2, gpus=1, gpucores=None, gpumem=1000)
    assert not capacity.gang_fit(zero_cores, one, full_cores).fits
    elsewhere = _spec("job", nnodes=2, gpus=1, node_selector={"kubernetes.io/hostname": "n2"})
    assert not capacity.gang_fit(elsewhere, one, []).fits
    other_type = _spec("job", nnodes=2, gpus=1, gpu_type=["A100"])
    assert not capacity.gang_fit(other_type, one, []).fits
    assert capacity.gang_fit(_spec("job", gpus=1, gpu_type=["3090"]), one, []).fits


def _seed_cluster(api: FakeApiServer, nodes: list[dict[str, Any]],
                  pods: list[dict[str, Any]]) -> None:
    for obj in [*nodes, *pods]:
        api.state.put(copy.deepcopy(obj))


GANG_JOB = ["train.py", "--name", "ddp", "--kind", "job", "--nnodes", "2", "--image", IMG,
            "--gpus", "2", "--gpumem", "12000", "--gpucores", "30"]


@pytest.mark.parametrize("legacy", [False, True], ids=["json-v2.8+", "colon-before-v2.8"])
def test_apply_refuses_a_gang_that_does_not_fit(legacy: bool, cli: Any, workdir: Path,
                                                fake_api: FakeApiServer) -> None:
    _seed_cluster(fake_api, [_node("10-60-18-8", [A, B], legacy)], BUSY)
    result = cli("k8s", "apply", *GANG_JOB)
    assert result.code == 2, result.err
    assert ("not all pods of ddp fit now: needs 2 pods × 2 slices of 12000 MiB and 30% "
            "cores; free now: node 10-60-18-8: 1 slice") in result.err
    assert fake_api.state.writes() == []
    forced = cli("k8s", "apply", *GANG_JOB, "--force")
    assert forced.code == 0 and "applied anyway (--force)" in forced.err
    assert "job/ddp created" in forced.out


def test_a_queue_or_gang_applies_what_does_not_fit_yet(cli: Any, workdir: Path,
                                                       fake_api: FakeApiServer) -> None:
    _seed_cluster(fake_api, [_node("10-60-18-8", [A, B])], BUSY)
    result = cli("k8s", "apply", *GANG_JOB, "--gang", "coscheduling")
    assert result.code == 0, result.err
    assert "the PodGroup holds them until they do" in result.err
    assert "podgroup/ddp created" in result.out


def test_apply_accepts_a_gang_that_fits(cli: Any, workdir: Path,
                                        fake_api: FakeApiServer) -> None:
    _seed_cluster(fake_api, [_node("10-60-18-8", [A, B]), _node("10-60-18-9", [C, D])],
                  BUSY[2:])
    result = cli("k8s", "apply", *GANG_JOB, "--queue", "team-a")
    assert result.code == 0, result.err
    assert "capacity: needs 2 pods" in result.out and "node 10-60-18-9: 4 slices" in result.out
    job = fake_api.state.objects[("jobs", "default", "ddp")]
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"


@pytest.mark.parametrize("kind", ["job", "pytorchjob", "jobset", "trainjob"])
def test_gang_objects_round_trip(kind: str, cli: Any, workdir: Path,
                                 fake_api: FakeApiServer) -> None:
    """apply creates the PodGroup / ClusterTrainingRuntime before the workload; delete
    removes every object apply made (PVCs excepted) and nothing else."""
    flags = ["train.py", "--name", "ddp", "--kind", kind, "--nnodes", "2", "--image", IMG,
             "--gang", "coscheduling"]
    fake_api.state.put({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "someone-else", "namespace": "default"}})
    assert cli("k8s", "apply", *flags).code == 0
    posts = [r.path.rsplit("/", 1)[-1] for r in fake_api.state.requests if r.method == "POST"]
    first = "clustertrainingruntimes" if kind == "trainjob" else "podgroups"
    workload = {"job": "jobs", "pytorchjob": "pytorchjobs", "jobset": "jobsets",
                "trainjob": "trainjobs"}[kind]
    assert first in posts and posts.index(first) < posts.index(workload)
    if kind == "trainjob":
        assert any(r.path == "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes"
                   for r in fake_api.state.requests if r.method == "POST")
    again = cli("k8s", "apply", *flags)
    assert again.code == 0 and "created" not in again.out  # idempotent
    deleted = cli("k8s", "delete", "ddp")
    assert deleted.code == 0, deleted.err
    gang_object = ("clustertrainingruntime/ddp.default" if kind == "trainjob"
                   else "podgroup/ddp")
    assert f"{gang_object} deleted" in deleted.out
    left = [k for k in fake_api.state.objects]
    assert left == [("configmaps", "default", "someone-else")]


def test_a_missing_crd_names_what_to_install(cli: Any, workdir: Path,
                                            fake_api: FakeApiServer) -> None:
    fake_api.state.absent = {"jobsets"}
    result = cli("k8s", "apply", "train.py", "--kind", "jobset", "--nnodes", "2",
                 "--image", IMG)
    assert result.code == 1 and "is the JobSet controller (v0.12) installed?" in result.err


# -- Pending reasons and the verdict -----------------------------------------------------
def _job_pod(i: int, phase: str, **status: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"ddp-node-0-{i}", "namespace": "default",
                         "labels": {"disttrain.io/job": "ddp"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}},
            "spec": {"schedulerName": "hami-scheduler",
                     "containers": [{"name": "trainer",
                                     "args": ["torchrun", "--nproc_per_node=2"]}]},
            "status": {"phase": phase, **status}}


UNSCHEDULABLE = ("0/3 nodes are available: 3 Insufficient nvidia.com/gpumem. preemption: "
                 "0/3 nodes are available: 3 No preemption victims found for incoming pod.")


@pytest.mark.parametrize("source", ["condition", "event"])
def test_status_says_why_a_pod_is_pending(source: str, cli: Any,
                                          fake_api: FakeApiServer) -> None:
    fake_api.state.put({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                        "metadata": {"name": "ddp", "namespace": "default",
                                     "labels": {"disttrain.io/job": "ddp"}}, "spec": {}})
    fake_api.state.put(_job_pod(0, "Running"))
    if source == "condition":
        fake_api.state.put(_job_pod(1, "Pending", conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": UNSCHEDULABLE}]))
    else:
        fake_api.state.put(_job_pod(1, "Pending"))
        for when, text in (("2026-01-01T00:00:01Z", "old"), ("2026-01-01T00:00:09Z",
                                                            UNSCHEDULABLE)):
            fake_api.state.put({"apiVersion": "v1", "kind": "Event",
                                "metadata": {"name": f"e{when[-3:-1]}", "namespace": "default"},
                                "reason": "FailedScheduling", "message": text,
                                "lastTimestamp": when,
                                "involvedObject": {"kind": "Pod", "name": "ddp-node-0-1"}})
    result = cli("k8s", "status", "ddp")
    assert result.code == 0, result.err
    assert "JobSet/ddp: created" in result.out
    assert f"pod ddp-node-0-1: Pending: {UNSCHEDULABLE}" in result.out
    assert (f"rendezvous: 2 of 4 ranks arrived; missing: pod ddp-node-0-1 (Pending: "
            f"{UNSCHEDULABLE})") in result.out


def test_logs_end_with_the_verdict_when_a_rank_failed_waiting(cli: Any,
                                                              fake_api: FakeApiServer) -> None:
    failed = _job_pod(0, "Failed", containerStatuses=[
        {"name": "trainer", "restartCount": 0,
         "state": {"terminated": {"exitCode": 1}}}])
    fake_api.state.put(failed)
    fake_api.state.put(_job_pod(1, "Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "message": UNSCHEDULABLE}]))
    fake_api.state.logs["ddp-node-0-0"] = "torch.distributed.elastic.rendezvous.api." \
                                          "RendezvousTimeoutError\n"
    result = cli("k8s", "logs", "ddp")
    assert result.code == 1
    assert result.err.rstrip().splitlines()[-1] == (
        f"error: 2 of 4 ranks arrived; missing: pod ddp-node-0-1 (Pending: {UNSCHEDULABLE})")


def test_several_nodes_meet_within_the_rendezvous_deadline(tmp_path: Path) -> None:
    """`disttrain run` on several nodes and every multi-pod render pass it to torchrun's
    own rendezvous (c10d join_timeout; 180 s unless launch.rdzv_timeout_s)."""
    from disttrain.launch.argv import torchrun_argv
    from disttrain.launch.plan import launch_config

    two = JobSpec.from_dict({"launch": {"nnodes": 2, "rdzv_timeout_s": 45}})
    config = launch_config(two.launch, 1, name="x", start_method="spawn", scratch_dir=tmp_path)
    assert config.rdzv_backend == "c10d" and config.rdzv_configs["join_timeout"] == 45
    assert "--rdzv_conf=join_timeout=45" in torchrun_argv(two, nproc=1)
    default = JobSpec.from_dict({"launch": {"nnodes": 2}})
    assert "--rdzv_conf=join_timeout=180" in torchrun_argv(default, nproc=1)
    assert not any("rdzv_conf" in a for a in torchrun_argv(JobSpec(), nproc=1))


def test_no_verdict_before_any_pod_started() -> None:
    pods = [_job_pod(0, "Pending"), _job_pod(1, "Pending")]
    assert pending.verdict_from_pods(pods) is None
    assert pending.pending_reason(pods[0]) == "Pending: not scheduled yet"
    assert pending.verdict_from_pods([_job_pod(0, "Running"), _job_pod(1, "Running")]) is None


# -- run-local's JobSet and TrainJob ------------------------------------------------------
@pytest.mark.parametrize("kind", ["jobset", "trainjob"])
def test_run_local_emulates_the_controllers(kind: str, workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "name": "ddp",
                              "launch": {"nnodes": 2, "nproc_per_node": 1},
                              "cluster": {"kind": kind, "gpus": 0}})
    pods = local.local_pods(render(spec, workdir, local=True).objects, spec)
    assert [p.name for p in pods] == ["ddp-node-0-0", "ddp-node-0-1"]
    assert pods[1].aliases[:2] == ("ddp-node-0-1.ddp.default.svc.cluster.local",
                                   "ddp-node-0-1.ddp")
    if kind == "jobset":
        assert "--node_rank=1" in pods[1].argv
        assert "--rdzv_endpoint=ddp-node-0-0.ddp:29500" in pods[1].argv
    else:
        env = pods[1].env
        assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_MASTER_ADDR"],
                env["PET_MASTER_PORT"]) == ("2", "1", "ddp-node-0-0.ddp", "29500")
        assert pods[1].argv[:3] == ("torchrun", "--nproc_per_node=1",
                                    "--rdzv_conf=timeout=180")


def test_unschedulable_pods_are_checked(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "launch": {"nnodes": 2, "nproc_per_node": 1},
                              "cluster": {"kind": "job", "gpus": 0}})
    pods = local.local_pods(render(spec, workdir, local=True).objects, spec)
    names = [p.name for p in pods]
    held = local.held_pods(pods, (names[1],))
    assert list(held) == [names[1]] and held[names[1]].startswith("Pending: ")
    with pytest.raises(LocalRunError, match="no such pod"):
        local.held_pods(pods, ("nope",))
    with pytest.raises(LocalRunError, match="holding every pod"):
        local.held_pods(pods, tuple(names))


def test_run_local_refuses_jobset_restarts_it_cannot_emulate(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py",
                              "launch": {"nnodes": 2, "nproc_per_node": 1, "max_restarts": 1},
                              "cluster": {"kind": "jobset", "gpus": 0}})
    with pytest.raises(LocalRunError, match="restart of all its pods"):
        local.backoff_limit(render(spec, workdir, local=True).objects)


@pytest.mark.parametrize("kind,path", [
    ("jobset", "JobSet/ddp: spec.replicatedJobs[0].template.spec.template.spec.volumes"),
    ("trainjob", "ClusterTrainingRuntime/ddp.default: spec.template.spec.replicatedJobs[0]"
                 ".template.spec.template.spec.volumes")])
def test_pod_security_sees_the_pods_inside_the_new_kinds(kind: str, path: str,
                                                         workdir: Path) -> None:
    spec = _spec(kind, volumes=[{"name": "scratch", "host_path": "/mnt/s", "mount": "/s"}])
    warnings = render(spec, workdir).warnings
    assert any(w.startswith(path) and "hostPath" in w and "baseline" in w for w in warnings)
