"""Client verbs against a fake API server: the real `kubernetes` client speaks HTTP to it
through a generated kubeconfig; the tests assert on the requests it received."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from k8s_fake_apiserver import FakeApiServer

IMG = ["--image", "registry.local/ml/train:1"]
POD_JOB = ["train.py", "--name", "ddp", *IMG, "--gpus", "2", "--gpumem", "12000"]
INDEXED = ["train.py", "--name", "ddp", "--kind", "job", "--nnodes", "2", *IMG]


def _calls(api: FakeApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.state.requests]


def test_apply_creates_then_is_idempotent(cli: Any, workdir: Path, fake_api: FakeApiServer) -> None:
    first = cli("k8s", "apply", *POD_JOB)
    assert first.code == 0, first.err
    assert "configmap/ddp-code created" in first.out and "pod/ddp created" in first.out
    posts = [r for r in fake_api.state.requests if r.method == "POST"]
    assert [r.path for r in posts] == ["/api/v1/namespaces/default/configmaps",
                                       "/api/v1/namespaces/default/pods"]
    pod = posts[1].body
    assert pod["spec"]["schedulerName"] == "hami-scheduler"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "12000"
    assert "disttrain.io/render-hash" in pod["metadata"]["annotations"]
    assert all(r.headers.get("authorization") == "Bearer fake-token"
               for r in fake_api.state.requests)

    fake_api.state.requests.clear()
    again = cli("k8s", "apply", *POD_JOB)
    assert again.code == 0, again.err
    assert "pod/ddp unchanged" in again.out and "configmap/ddp-code unchanged" in again.out
    assert fake_api.state.writes() == []  # a no-op: reads only


def test_apply_replaces_a_changed_job(cli: Any, workdir: Path, fake_api: FakeApiServer) -> None:
    assert cli("k8s", "apply", *POD_JOB).code == 0
    fake_api.state.requests.clear()
    (workdir / "train.py").write_text("print('v2')\n")
    changed = cli("k8s", "apply", *POD_JOB, "--gpucores", "50")
    assert changed.code == 0, changed.err
    assert "configmap/ddp-code replaced" in changed.out and "pod/ddp replaced" in changed.out
    writes = [(r.method, r.path) for r in fake_api.state.writes()]
    assert writes == [("PUT", "/api/v1/namespaces/default/configmaps/ddp-code"),
                      ("DELETE", "/api/v1/namespaces/default/pods/ddp"),
                      ("POST", "/api/v1/namespaces/default/pods")]
    delete = next(r for r in fake_api.state.requests if r.method == "DELETE")
    assert delete.query.get("propagationPolicy") == ["Foreground"]
    pod = fake_api.state.objects[("pods", "default", "ddp")]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] == "50"
    assert "v2" in fake_api.state.objects[("configmaps", "default", "ddp-code")]["data"][
        "train.py"]


def test_changing_kind_prunes_the_old_kinds_objects_both_ways(cli: Any, workdir: Path,
                                                              fake_api: FakeApiServer) -> None:
    """Pod -> Indexed Job (+ Service) -> Pod: each apply prunes what the other kind made."""
    assert cli("k8s", "apply", *POD_JOB).code == 0
    result = cli("k8s", "apply", *INDEXED)
    assert result.code == 0, result.err
    assert "service/ddp created" in result.out and "job/ddp created" in result.out
    assert "pod/ddp pruned" in result.out
    assert ("pods", "default", "ddp") not in fake_api.state.objects
    job = fake_api.state.objects[("jobs", "default", "ddp")]
    assert job["spec"]["completionMode"] == "Indexed"
    result = cli("k8s", "apply", *POD_JOB)
    assert result.code == 0, result.err
    assert "job/ddp pruned" in result.out and "service/ddp pruned" in result.out
    assert {k[0] for k in fake_api.state.objects} == {"pods", "configmaps"}


def test_new_code_alone_restarts_the_job(cli: Any, workdir: Path,
                                         fake_api: FakeApiServer) -> None:
    assert cli("k8s", "apply", *POD_JOB).code == 0
    (workdir / "train.py").write_text("print('fixed a bug')\n")
    result = cli("k8s", "apply", *POD_JOB)
    assert "configmap/ddp-code replaced" in result.out and "pod/ddp replaced" in result.out


def test_apply_in_the_spec_namespace(cli: Any, workdir: Path, fake_api: FakeApiServer) -> None:
    assert cli("k8s", "apply", *POD_JOB, "--namespace", "ml").code == 0
    assert ("POST", "/api/v1/namespaces/ml/pods") in _calls(fake_api)


def test_apply_dry_run_contacts_nothing(cli: Any, workdir: Path, fake_api: FakeApiServer,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(workdir / "no-such-kubeconfig"))
    result = cli("k8s", "apply", *POD_JOB, "--dry-run")
    assert result.code == 0, result.err
    assert "kind: Pod" in result.out and "kind: ConfigMap" in result.out
    assert fake_api.state.requests == []


def test_pytorchjob_without_the_operator(cli: Any, workdir: Path,
                                         fake_api: FakeApiServer) -> None:
    fake_api.state.crds = False
    result = cli("k8s", "apply", "train.py", "--kind", "pytorchjob", *IMG)
    assert result.code == 1
    assert "training operator" in result.err and "Traceback" not in result.err


def test_pytorchjob_apply_uses_the_custom_objects_api(cli: Any, workdir: Path,
                                                      fake_api: FakeApiServer) -> None:
    result = cli("k8s", "apply", "train.py", "--name", "ptj", "--kind", "pytorchjob",
                 "--nnodes", "2", *IMG)
    assert result.code == 0, result.err
    assert ("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs") in _calls(fake_api)


def _job_pod(index: int, phase: str, *, scheduler: str = "hami-scheduler",
             exit_code: int | None = None, allocated: bool = True) -> dict[str, Any]:
    notes = {"batch.kubernetes.io/job-completion-index": str(index)}
    if allocated:
        notes["hami.io/vgpu-devices-allocated"] = "GPU-x,NVIDIA,12000,0:;"
    state = {"terminated": {"exitCode": exit_code}} if exit_code is not None else {"running": {}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"ddp-{index}-abcde", "namespace": "default",
                         "labels": {"disttrain.io/job": "ddp", "job-name": "ddp"},
                         "annotations": notes,
                         "ownerReferences": [{"kind": "Job", "name": "ddp"}]},
            "spec": {"schedulerName": scheduler, "nodeName": f"node-{index}",
                     "containers": [{"name": "trainer", "resources": {"limits": {
                         "nvidia.com/gpu": "2", "nvidia.com/gpumem": "12000"}}}]},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "trainer", "restartCount": index, "state": state}]}}


@pytest.fixture
def running_job(cli: Any, workdir: Path, fake_api: FakeApiServer) -> FakeApiServer:
    assert cli("k8s", "apply", *INDEXED).code == 0
    fake_api.state.put(_job_pod(0, "Running"))
    fake_api.state.put(_job_pod(1, "Running", scheduler="default-scheduler", allocated=False))
    fake_api.state.logs = {"ddp-0-abcde": "epoch 1 loss 0.5\nepoch 2 loss 0.2\n",
                           "ddp-1-abcde": "epoch 1 loss 0.5\n"}
    fake_api.state.requests.clear()
    return fake_api


def test_status_shows_pods_and_warns_about_the_scheduler(cli: Any,
                                                         running_job: FakeApiServer) -> None:
    result = cli("k8s", "status", "ddp")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("Job/ddp")
    assert lines[1].split() == ["RANK", "POD", "PHASE", "RESTARTS", "NODE", "GPU", "SCHEDULER"]
    assert lines[2].split() == ["0", "ddp-0-abcde", "Running", "0", "node-0", "gpu=2",
                                "gpumem=12000", "hami-scheduler"]
    assert lines[3].split()[:5] == ["1", "ddp-1-abcde", "Running", "1", "node-1"]
    assert "warning: pod ddp-1-abcde asks for HAMi vGPU resources" in result.err
    assert "default-scheduler" in result.err
    assert running_job.state.writes() == []
    sel = [r for r in running_job.state.requests if r.path.endswith("/pods")]
    assert sel[0].query["labelSelector"] == ["disttrain.io/job=ddp"]


def test_status_of_an_unknown_job(cli: Any, fake_api: FakeApiServer) -> None:
    result = cli("k8s", "status", "nothing", "-n", "ml")
    assert result.code == 1
    assert "no disttrain job 'nothing' in namespace ml" in result.err


def test_logs_prefix_every_line_with_rank_and_pod(cli: Any, running_job: FakeApiServer) -> None:
    result = cli("k8s", "logs", "ddp")
    assert result.code == 0, result.err
    assert "[rank 0 ddp-0-abcde] epoch 2 loss 0.2" in result.out.splitlines()
    assert "[rank 1 ddp-1-abcde] epoch 1 loss 0.5" in result.out.splitlines()
    log_calls = [r for r in running_job.state.requests if r.path.endswith("/log")]
    assert {r.query["container"][0] for r in log_calls} == {"trainer"}


def test_logs_follow_waits_and_streams(cli: Any, running_job: FakeApiServer) -> None:
    running_job.state.put(_job_pod(0, "Succeeded", exit_code=0))
    running_job.state.logs["ddp-0-abcde"] += "partial line without newline"
    result = cli("k8s", "logs", "-f", "ddp")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines.count("[rank 0 ddp-0-abcde] epoch 1 loss 0.5") == 1
    assert "[rank 0 ddp-0-abcde] partial line without newline" in lines
    log_calls = [r for r in running_job.state.requests if r.path.endswith("/log")]
    assert all(r.query.get("follow") == ["true"] for r in log_calls)


@pytest.fixture
def failed_job(running_job: FakeApiServer) -> FakeApiServer:
    running_job.state.put(_job_pod(1, "Failed", exit_code=1))
    running_job.state.logs["ddp-1-abcde"] = "RuntimeError: NCCL error: unhandled system error\n"
    return running_job


def test_failed_pod_log_goes_to_the_doctor(cli: Any, failed_job: FakeApiServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    doctor = types.ModuleType("disttrain.diagnose.logs")

    def diagnose(text: str) -> Any:
        seen.append(text)
        return types.SimpleNamespace(cause="nccl", title="NCCL init failed", rank=1, host=None,
                                     evidence=[], fix="set NCCL_SOCKET_IFNAME", consequences="")

    doctor.diagnose = diagnose  # type: ignore[attr-defined]
    doctor.format_diagnosis = lambda d: f"doctor: {d.title}; fix: {d.fix}"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "disttrain.diagnose.logs", doctor)
    result = cli("k8s", "logs", "ddp")
    assert result.code == 1
    assert "error: pod ddp-1-abcde failed" in result.err
    assert "doctor: NCCL init failed; fix: set NCCL_SOCKET_IFNAME" in result.err
    assert seen == ["RuntimeError: NCCL error: unhandled system error"]


def test_failed_pod_without_the_doctor_module(cli: Any, failed_job: FakeApiServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "disttrain.diagnose.logs", None)  # ImportError
    result = cli("k8s", "logs", "ddp")
    assert result.code == 1
    assert "error: pod ddp-1-abcde failed" in result.err and "Traceback" not in result.err


def test_delete_removes_only_what_disttrain_made(cli: Any, running_job: FakeApiServer) -> None:
    running_job.state.put({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "ddp-code-other", "namespace": "default"}})
    result = cli("k8s", "delete", "ddp")
    assert result.code == 0, result.err
    assert result.out.split() == ["job/ddp", "deleted", "service/ddp", "deleted",
                                  "configmap/ddp-code", "deleted"]
    deletes = [r.path for r in running_job.state.requests if r.method == "DELETE"]
    assert deletes == ["/apis/batch/v1/namespaces/default/jobs/ddp",
                       "/api/v1/namespaces/default/services/ddp",
                       "/api/v1/namespaces/default/configmaps/ddp-code"]
    assert ("configmaps", "default", "ddp-code-other") in running_job.state.objects


def test_delete_refuses_objects_without_the_job_label(cli: Any, fake_api: FakeApiServer) -> None:
    fake_api.state.put({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "ddp", "namespace": "default"}})
    result = cli("k8s", "delete", "ddp")
    assert result.code == 1 and "no disttrain job 'ddp'" in result.err
    assert fake_api.state.writes() == []


def test_delete_waits_until_the_object_is_gone(fake_api: FakeApiServer, tmp_path: Path) -> None:
    from disttrain.k8s.client import Cluster, ObjectRef

    fake_api.state.put({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "p", "namespace": "default"}})
    fake_api.state.delete_lingers = 3
    cluster = Cluster.from_kubeconfig(str(tmp_path / "kubeconfig"))
    cluster.poll_s = 0.01
    assert cluster.delete(ObjectRef("Pod", "default", "p")) is True
    gets = [r for r in fake_api.state.requests if r.method == "GET"]
    assert len(gets) == 3


def test_kubeconfig_search_order(fake_api: FakeApiServer, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.k8s import client, kubeconfig

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(kubeconfig, "K3S_KUBECONFIG", str(tmp_path / "k3s.yaml"))
    assert client.find_kubeconfig() == str(tmp_path / "kubeconfig")  # $KUBECONFIG
    monkeypatch.delenv("KUBECONFIG")
    with pytest.raises(client.KubeError, match="no kubeconfig found"):
        client.find_kubeconfig()
    fake_api.write_kubeconfig(tmp_path / "k3s.yaml")
    assert client.find_kubeconfig() == str(tmp_path / "k3s.yaml")
    (home / ".kube").mkdir(parents=True)
    fake_api.write_kubeconfig(home / ".kube" / "config")
    assert client.find_kubeconfig() == str(home / ".kube" / "config")
    assert client.find_kubeconfig(str(tmp_path / "k3s.yaml")) == str(tmp_path / "k3s.yaml")


def test_kubeconfig_flag_and_missing_kubeconfig(cli: Any, fake_api: FakeApiServer,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    result = cli("k8s", "status", "ddp")
    assert result.code == 1 and "KUBECONFIG" in result.err and "Traceback" not in result.err
    result = cli("k8s", "status", "ddp", "--kubeconfig", str(tmp_path / "kubeconfig"))
    assert result.code == 1 and "no disttrain job" in result.err  # reached the server


def test_unreachable_server(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApiServer()  # never started: nothing listens on its port
    path = api.write_kubeconfig(tmp_path / "dead")
    api.httpd.server_close()
    monkeypatch.setenv("KUBECONFIG", str(path))
    result = cli("k8s", "status", "ddp")
    assert result.code == 1 and "cannot reach the API server" in result.err
    assert "Traceback" not in result.err
