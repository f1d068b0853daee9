"""Rendering: every kind and option gives objects valid against the official schemas, and
the HAMi / torchrun / security rules of docs/cluster.md hold."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import validate_all, validate_object
from disttrain.errors import SpecError
from disttrain.k8s.hami import HAMI_KEYS
from disttrain.k8s.render import render, to_json, to_yaml
from disttrain.k8s.security import pod_specs
from disttrain.k8s.stopping import STOP_SCRIPT
from disttrain.spec.job import JobSpec

IMG = "registry.local:30000/ml/train:1"
BUILTIN = {"image_has_disttrain": True}

CASES: dict[str, dict[str, Any]] = {
    "pod-script-configmap": {"script": "train.py", "cluster": {"image": IMG, "gpus": 2}},
    "pod-guide-hostpath": {"script": "train.py", "launch": {"master_port": 12355},
                           "cluster": {"image": IMG, "gpus": 2, "gpumem": "12k",
                                       "code": {"host_path": "/opt/training-code"},
                                       "cpu": {"request": "2", "limit": "8"},
                                       "memory": {"request": "8Gi", "limit": "16Gi"},
                                       "volumes": [{"name": "models", "pvc": "nfs-modelscope",
                                                    "mount": "/models", "read_only": True}],
                                       "env": {"HF_ENDPOINT": "https://hf-mirror.com"},
                                       "nccl_preset": "debug"}},
    "pod-builtin-image": {"cluster": {"image": IMG, **BUILTIN}},
    "pod-builtin-install": {"example": "synthetic",
                            "cluster": {"image": IMG, "install_disttrain": "disttrain==0.1.0",
                                        "pip_index_url": "http://10.0.0.5:3141/root/pypi"}},
    "pod-hami-all": {"script": "train.py", "launch": {"nproc_per_node": 2},
                     "cluster": {"image": IMG, "gpus": 4, "gpumem_percentage": 50,
                                 "gpucores": 30, "gpu_type": "A100,3090",
                                 "gpu_type_exclude": ["T4"],
                                 "gpu_uuid": ["GPU-03f69c50-207a-2038-9b45-23cac89cb67d"],
                                 "gpu_uuid_exclude": "GPU-13f69c50-207a-2038-9b45-23cac89cb67d",
                                 "gpu_policy": "binpack,numa", "node_policy": "spread",
                                 "runtime_class": "nvidia"}},
    "pod-cpu-only": {"script": "train.py", "launch": {"backend": "gloo", "nproc_per_node": 2},
                     "cluster": {"image": IMG, "gpus": 0, "scheduler": None, "shm": None}},
    "pod-pvc-code-extras": {"script": "train.py",
                            "cluster": {"image": IMG, "code": {"pvc": "code-pvc"},
                                        "image_pull_secrets": "regcred,other",
                                        "labels": {"team": "ml"}, "add_capabilities": ["IPC_LOCK"],
                                        "volumes": [{"name": "data", "pvc": "train-data",
                                                     "mount": "/data", "create": True,
                                                     "size": "50Gi", "storage_class": "nfs",
                                                     "access_mode": "ReadWriteMany"}]}},
    "pod-nccl-all": {"script": "train.py",
                     "cluster": {"image": IMG, "nccl_preset": "ib", "nccl_socket_ifname": "eth0",
                                 "vgpu_workarounds": "no-p2p,no-shm,no-cumem-host,"
                                                     "no-vgpu-control"}},
    "job-script-files": {"script": "train.py", "launch": {"nnodes": 2},
                         "cluster": {"kind": "job", "image": IMG, "gpus": 2, "gpumem": 8000,
                                     "code": {"files": ["helpers"]}}},
    "job-builtin-hostpath": {"launch": {"nnodes": 3, "max_restarts": 2},
                             "cluster": {"kind": "job", "image": IMG, **BUILTIN,
                                         "code": {"host_path": "/opt/code"},
                                         "volumes": [{"name": "scratch", "host_path": "/mnt/s",
                                                      "mount": "/scratch"}]}},
    "pytorchjob-1": {"script": "train.py", "cluster": {"kind": "pytorchjob", "image": IMG}},
    "pytorchjob-3": {"script": "train.py", "launch": {"nnodes": 3},
                     "cluster": {"kind": "pytorchjob", "image": IMG, "gpus": 2,
                                 "gpumem": 10000, "gpucores": 50}},
    "pytorchjob-elastic": {"script": "train.py", "launch": {"nnodes": 2, "max_restarts": 3},
                           "cluster": {"kind": "pytorchjob", "image": IMG,
                                       "elastic_nodes": "1:4"}},
    "pytorchjob-builtin-install": {"launch": {"nnodes": 2},
                                   "cluster": {"kind": "pytorchjob", "image": IMG,
                                               "install_disttrain": "disttrain"}},
}


@pytest.fixture
def code_dir(workdir: Path) -> Path:
    (workdir / "helpers").mkdir()
    (workdir / "helpers" / "util.py").write_text("X = 1\n")
    (workdir / "helpers" / "blob.bin").write_bytes(bytes(range(256)))
    return workdir


def _render(case: str, base: Path) -> Any:
    return render(JobSpec.from_dict(CASES[case]), base)


def _pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [spec for obj in objects for _, spec in pod_specs(obj)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_kind_and_option_is_schema_valid(case: str, code_dir: Path) -> None:
    validate_all(_render(case, code_dir).objects)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pod_invariants(case: str, code_dir: Path) -> None:
    spec = JobSpec.from_dict(CASES[case])
    objects = render(spec, code_dir).objects
    for obj in objects:
        assert obj["metadata"]["labels"]["disttrain.io/job"] == spec.name
        assert obj["metadata"]["namespace"] == "default"
    for pod in _pods(objects):
        assert pod["restartPolicy"] == "Never"
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert pod.get("schedulerName") == spec.cluster.scheduler
        (ctr,) = pod["containers"]
        # PID 1 is the stop wrapper around the torchrun argv; the kubelet waits the job's
        # stop grace plus torchrun's teardown, and torchrun waits the stop grace
        assert ctr["command"][0] == "sh" and ctr["command"][2].endswith(STOP_SCRIPT)
        assert ctr["args"][0] == "torchrun"
        assert pod["terminationGracePeriodSeconds"] == spec.launch.stop_grace_s + 15
        assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "value": str(spec.launch.stop_grace_s)} in ctr["env"]
        sc = ctr["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert "privileged" not in sc
        res = ctr["resources"]
        hami = {k: v for k, v in res.get("limits", {}).items() if k in HAMI_KEYS}
        assert not any(k in HAMI_KEYS for k in res.get("requests", {})) or \
            {k: v for k, v in res["requests"].items() if k in HAMI_KEYS} == hami
        if hami:
            assert hami["nvidia.com/gpu"] == str(spec.cluster.gpus)
            assert all(v.isdigit() for v in hami.values())  # integers: MiB, %, count
        nproc = next(a for a in " ".join(ctr["args"]).replace("'", "").split()
                     if a.startswith("--nproc_per_node="))
        if spec.cluster.gpus:
            assert int(nproc.split("=")[1]) <= spec.cluster.gpus
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        if spec.cluster.shm:
            assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                        "sizeLimit": spec.cluster.shm}}]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in ctr["volumeMounts"]
        else:
            assert not shm


def test_yaml_and_json_output_round_trip(code_dir: Path) -> None:
    objects = _render("job-script-files", code_dir).objects
    text = to_yaml(objects)
    assert "*id" not in text and "&id" not in text  # no YAML aliases
    assert list(yaml.safe_load_all(text)) == objects
    assert json.loads(to_json(objects))["items"] == objects


def test_job_is_indexed_with_headless_service_and_rank0_dns(code_dir: Path) -> None:
    objects = _render("job-script-files", code_dir).objects
    kinds = [o["kind"] for o in objects]
    assert kinds == ["ConfigMap", "Service", "Job"]
    svc, job = objects[1], objects[2]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    tmpl = job["spec"]["template"]
    assert all(tmpl["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = tmpl["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "train"  # named after train.py
    cmd = pod["containers"][0]["args"]
    assert cmd[:2] == ["torchrun", "--nnodes=2"]
    assert "--rdzv_backend=c10d" in cmd
    assert "--rdzv_endpoint=train-0.train:29500" in cmd  # pod 0's DNS name
    assert "--node_rank=$(JOB_COMPLETION_INDEX)" in cmd
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"]["value"] == "train-0.train"
    assert "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"][
        "fieldPath"]
    assert cmd[-1] == "/workspace/train.py"


def test_configmap_code_is_mounted_file_by_file_into_a_writable_workspace(code_dir: Path) -> None:
    cm, _, job = _render("job-script-files", code_dir).objects
    assert set(cm["data"]) == {"train.py", "helpers__util.py"}
    assert set(cm["binaryData"]) == {"helpers__blob.bin"}
    ctr = job["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    assert mounts["/workspace"]["name"] == "workspace"
    assert mounts["/workspace/helpers/util.py"] == {
        "name": "code", "mountPath": "/workspace/helpers/util.py", "subPath": "helpers__util.py",
        "readOnly": True}
    assert ctr["workingDir"] == "/workspace"
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["workspace"] == {"name": "workspace", "emptyDir": {}}
    assert vols["code"]["configMap"]["name"] == "train-code"  # the script's stem (issue 25 item 8)


def test_pytorchjob_master_worker_and_container_name(code_dir: Path) -> None:
    job = _render("pytorchjob-3", code_dir).objects[-1]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    assert job["spec"]["nprocPerNode"] == "2"
    for r in replicas.values():
        assert r["restartPolicy"] == "Never"
        ctr = r["template"]["spec"]["containers"][0]
        assert ctr["name"] == "pytorch"  # the operator requires this name
        assert ctr["ports"][0]["name"] == "pytorchjob-port"
        assert ctr["args"][:2] == ["torchrun", "--nproc_per_node=2"]
        assert "--rdzv_backend=c10d" not in ctr["args"]  # PET_* from the operator
        assert r["template"]["spec"]["schedulerName"] == "hami-scheduler"
    assert replicas["Worker"]["template"]["metadata"]["annotations"][
        "disttrain.io/rank-offset"] == "1"


def test_pytorchjob_elastic_uses_workers_only(code_dir: Path) -> None:
    job = _render("pytorchjob-elastic", code_dir).objects[-1]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4,
                                            "rdzvBackend": "c10d", "rdzvId": "train",
                                            "maxRestarts": 3,
                                            "rdzvConf": [{"key": "join_timeout",
                                                          "value": "180"}]}
    assert "nProcPerNode" not in job["spec"]["elasticPolicy"]  # forbidden with nprocPerNode


def test_hami_annotations_go_on_the_pod(code_dir: Path) -> None:
    (pod,) = _render("pod-hami-all", code_dir).objects[-1:]
    notes = pod["metadata"]["annotations"]
    assert notes["nvidia.com/use-gputype"] == "A100,3090"
    assert notes["nvidia.com/nouse-gputype"] == "T4"
    assert notes["nvidia.com/use-gpuuuid"].startswith("GPU-03f69c50")
    assert notes["nvidia.com/nouse-gpuuuid"].startswith("GPU-13f69c50")
    assert notes["hami.io/gpu-scheduler-policy"] == "binpack,numa"
    assert notes["hami.io/node-scheduler-policy"] == "spread"
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "4", "nvidia.com/gpumem-percentage": "50",
                      "nvidia.com/gpucores": "30"}
    assert pod["spec"]["runtimeClassName"] == "nvidia"


def test_job_template_carries_hami_annotations() -> None:
    spec = JobSpec.from_dict({"script": "/abs/train.py", "launch": {"nnodes": 2},
                              "cluster": {"kind": "job", "image": IMG, "gpu_type": "3090",
                                          "code": {"pvc": "code"}}})
    job = render(spec).objects[-1]
    assert "nvidia.com/use-gputype" not in job["metadata"].get("annotations", {})
    assert job["spec"]["template"]["metadata"]["annotations"]["nvidia.com/use-gputype"] == "3090"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "/abs/train.py"


@pytest.mark.parametrize(("preset", "env"), [
    ("default", {}), ("debug", {"NCCL_DEBUG": "INFO"}), ("no-ib", {"NCCL_IB_DISABLE": "1"}),
    ("no-p2p", {"NCCL_P2P_DISABLE": "1"}),
    ("ib", {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "2"}),
])
def test_nccl_presets(preset: str, env: dict[str, str], workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py",
                              "cluster": {"image": IMG, "nccl_preset": preset}})
    got = {e["name"]: e["value"] for e in render(spec).objects[-1]["spec"]["containers"][0]["env"]
           if e["name"].startswith("NCCL_")}
    assert got == env


def test_socket_ifname_and_vgpu_workarounds(code_dir: Path) -> None:
    env = {e["name"]: e["value"]
           for e in _render("pod-nccl-all", code_dir).objects[-1]["spec"]["containers"][0]["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
    assert env["NCCL_CUMEM_HOST_ENABLE"] == "0" and env["CUDA_DISABLE_CONTROL"] == "true"
    warnings = _render("pod-nccl-all", code_dir).warnings
    assert any("isolation off" in w for w in warnings)


def test_workarounds_are_opt_in(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "cluster": {"image": IMG}})
    names = {e["name"] for e in render(spec).objects[-1]["spec"]["containers"][0]["env"]}
    assert not names & {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_CUMEM_HOST_ENABLE",
                        "CUDA_DISABLE_CONTROL", "NCCL_DEBUG"}


def test_user_env_wins_over_rendered_env(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "cluster": {
        "image": IMG, "nccl_preset": "debug", "env": {"NCCL_DEBUG": "WARN"}}})
    env = render(spec).objects[-1]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "NCCL_DEBUG"] == ["WARN"]


def test_builtin_job_ships_its_spec_and_says_what_the_image_needs(code_dir: Path) -> None:
    cm, pod = _render("pod-builtin-image", code_dir).objects
    assert list(cm["data"]) == ["job.yaml"]
    shipped = JobSpec.from_dict(yaml.safe_load(cm["data"]["job.yaml"]))
    assert shipped.task == "disttrain.examples.digits:make_task" and shipped.name == "disttrain"
    ctr = pod["spec"]["containers"][0]
    assert ctr["args"][-4:] == ["-m", "disttrain.worker", "--spec", "/etc/disttrain/job.yaml"]
    assert {"name": "code", "mountPath": "/etc/disttrain/job.yaml", "subPath": "job.yaml",
            "readOnly": True} in ctr["volumeMounts"]
    assert pod["metadata"]["labels"]["disttrain.io/needs-disttrain"] == "true"
    assert "disttrain" in pod["metadata"]["annotations"]["disttrain.io/image-needs"]
    assert ("image needs: torch >= 2.1 and disttrain (task disttrain.examples.digits:make_task"
            in to_yaml([pod]))


def test_builtin_job_with_hostpath_code_gets_the_spec_from_a_configmap(code_dir: Path) -> None:
    cm, _svc, job = _render("job-builtin-hostpath", code_dir).objects
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["code"]["hostPath"]["path"] == "/opt/code"
    assert vols["jobspec"]["configMap"]["name"] == cm["metadata"]["name"]
    assert "--max_restarts=2" in job["spec"]["template"]["spec"]["containers"][0]["args"]


def test_install_disttrain_at_start_from_a_plain_http_mirror(code_dir: Path) -> None:
    _cm, pod = _render("pod-builtin-install", code_dir).objects
    ctr = pod["spec"]["containers"][0]
    sh, dash_c, script, _name = ctr["command"]
    assert (sh, dash_c) == ("sh", "-c")
    setup, _, wrapper = script.partition("\n")
    assert setup.startswith("python -c ")
    assert (" > /tmp/disttrain-constraints.txt && python -m pip install --no-cache-dir -c "
            "/tmp/disttrain-constraints.txt --index-url http://10.0.0.5:3141/root/pypi "
            "--trusted-host 10.0.0.5 disttrain==0.1.0 || exit $?") in setup
    assert wrapper == STOP_SCRIPT and ctr["args"][0] == "torchrun"  # installed, then torchrun
    assert "pip-installed at start from http://10.0.0.5:3141" in pod["metadata"]["annotations"][
        "disttrain.io/image-needs"]


def test_install_keeps_kubernetes_var_expansion(code_dir: Path) -> None:
    spec = JobSpec.from_dict({"launch": {"nnodes": 2}, "cluster": {
        "kind": "job", "image": IMG, "install_disttrain": "disttrain"}})
    ctr = render(spec, code_dir).objects[-1]["spec"]["template"]["spec"]["containers"][0]
    assert "--node_rank=$(JOB_COMPLETION_INDEX)" in ctr["args"]  # kubelet expands it
    assert "$(" not in ctr["command"][2]  # and nothing in the script looks like $(VAR)


def test_pvc_creation_and_pull_secrets(code_dir: Path) -> None:
    pvc, pod = _render("pod-pvc-code-extras", code_dir).objects  # code on a PVC: no ConfigMap
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == "train-data"
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                           "resources": {"requests": {"storage": "50Gi"}}}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["spec"]["containers"][0]["args"][-1] == "/workspace/train.py"


def test_security_warnings_name_the_field(code_dir: Path) -> None:
    warnings = _render("pod-pvc-code-extras", code_dir).warnings
    assert any("securityContext.capabilities.add: IPC_LOCK" in w and "baseline" in w
               for w in warnings)
    warnings = _render("job-builtin-hostpath", code_dir).warnings
    assert any("spec.template.spec.volumes[0].hostPath" in w for w in warnings)
    assert any("host_path" in w and "pins the job" in w for w in warnings)
    assert not [w for w in _render("pod-script-configmap", code_dir).warnings if "baseline" in w]


def test_rwo_pvc_shared_by_multinode_pods_warns(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "launch": {"nnodes": 2}, "cluster": {
        "kind": "job", "image": IMG, "volumes": [{"name": "data", "pvc": "d", "mount": "/d",
                                                  "create": True, "size": "1Gi"}]}})
    assert any("ReadWriteOnce" in w for w in render(spec).warnings)


def test_non_hami_scheduler_warns(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "cluster": {"image": IMG, "gpumem": 1000,
                                                                "scheduler": "volcano"}})
    assert any("volcano" in w and "hami-scheduler" in w for w in render(spec).warnings)


def test_nproc_auto_is_one_per_gpu(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "cluster": {"image": IMG, "gpus": 3}})
    assert "--nproc_per_node=3" in render(spec).objects[-1]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("data", "match"), [
    ({"script": "train.py", "launch": {"nproc_per_node": 4}, "cluster": {"gpus": 2}},
     "Duplicate GPU"),
    ({"script": "train.py", "launch": {"nnodes": 2}, "cluster": {}}, "kind pod runs one node"),
    ({"script": "train.py", "launch": {"backend": "nccl"}, "cluster": {"gpus": 0}}, "nccl"),
    ({"script": "train.py", "cluster": {"elastic_nodes": "1:2"}}, "elasticPolicy"),
    ({"script": "train.py", "launch": {"nnodes": 5},
      "cluster": {"kind": "pytorchjob", "elastic_nodes": "1:4"}}, "outside"),
    ({"name": "9lives", "script": "train.py", "launch": {"nnodes": 2}, "cluster": {"kind": "job"}},
     "DNS-1035"),
    ({"name": "a" * 62, "script": "train.py", "launch": {"nnodes": 2}, "cluster": {"kind": "job"}},
     "63 characters"),
    ({"script": "train.py", "cluster": {"cpu": {"request": "4", "limit": "2"}}}, "above limit"),
    ({"cluster": {}}, "needs disttrain"),
    ({"script": "train.py", "cluster": {"labels": {"disttrain.io/job": "x"}}}, "set by disttrain"),
    ({"script": "train.py", "cluster": {"labels": {"bad key": "x"}}}, "label key"),
    ({"script": "train.py", "cluster": {"labels": {"team": "a b"}}}, "label value"),
    ({"script": "missing.py", "cluster": {}}, "no such file"),
])
def test_render_refuses_with_the_field(data: dict[str, Any], match: str, workdir: Path) -> None:
    data = {**data, "cluster": {"image": IMG, **data["cluster"]}}
    with pytest.raises(SpecError, match=match):
        render(JobSpec.from_dict(data), workdir)


def test_render_needs_an_image(workdir: Path) -> None:
    with pytest.raises(SpecError, match=r"cluster\.image"):
        render(JobSpec.from_dict({"script": "train.py"}))
    # run-local needs none: this machine is the image
    assert render(JobSpec.from_dict({"script": "train.py"}), local=True).objects


def test_render_imports_no_kubernetes_client() -> None:
    code = ("import sys\nfrom disttrain.cli.main import main\n"
            "import disttrain.k8s.render, disttrain.k8s.client, disttrain.cli.k8s_cmd\n"
            "main(['k8s', 'render', '--image', 'x', '--image-has-disttrain'])\n"
            "assert 'kubernetes' not in sys.modules, 'render imported kubernetes'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_the_schema_checks_can_fail(code_dir: Path) -> None:
    """A typo anywhere must be caught, or the validity tests above prove nothing."""
    pod = _render("pod-script-configmap", code_dir).objects[-1]
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(bad)
    job = _render("pytorchjob-3", code_dir).objects[-1]
    bad = copy.deepcopy(job)
    bad["spec"]["nprocPerNodes"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resourcez"] = {}
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_object(bad)


@pytest.mark.parametrize(("text", "value"), [("8Gi", 8 * 2**30), ("500m", 0.5), ("1e3", 1000),
                                             ("2", 2), ("1.5G", 1.5e9)])
def test_quantity(text: str, value: float) -> None:
    from disttrain.k8s.render import quantity

    assert float(quantity(text)) == value


def test_script_with_install_says_it_needs_disttrain(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "cluster": {
        "image": IMG, "install_disttrain": "disttrain"}})
    pod = render(spec).objects[-1]
    assert pod["metadata"]["labels"]["disttrain.io/needs-disttrain"] == "true"
    assert "pip-installed" in pod["metadata"]["annotations"]["disttrain.io/image-needs"]
    assert pod["spec"]["containers"][0]["command"][0] == "sh"


def test_restart_settings_reach_the_cluster_objects():
    """With --max-restarts the rendered objects retry and the built-in job resumes
    (docs/resilience.md, "On the cluster")."""
    import yaml

    from disttrain.k8s.render import render
    from disttrain.spec.job import JobSpec

    spec = JobSpec.from_dict({}, {"kind": "job", "nnodes": 2, "max_restarts": 2, "gpus": 1,
                                  "image": "r/i:1", "image_has_disttrain": True})
    objs = render(spec).objects
    job = next(o for o in objs if o["kind"] == "Job")
    assert job["spec"]["backoffLimit"] == 2
    cmd = " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--max_restarts=2" in cmd
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    shipped = yaml.safe_load(next(v for k, v in cm["data"].items() if k.endswith("job.yaml")))
    assert shipped["train"]["resume"] is True
    spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"kind": "pytorchjob"})})
    pj = next(o for o in render(spec).objects if o["kind"] == "PyTorchJob")
    assert pj["spec"]["runPolicy"]["backoffLimit"] == 2
    assert pj["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"
