"""`disttrain k8s top`: the job's pods listed through the real client against the fake API
server, the run dir read from the job's ConfigMap, each pod's live files read by the exec
command (run here, in a folder standing for that pod's filesystem: the fake server speaks
no websocket)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from k8s_fake_apiserver import FakeApiServer
from tests.monitor.conftest import write_schema_run

from disttrain.k8s.client import Cluster

JOB = ["--name", "ddp", "--image-has-disttrain", "--kind", "job", "--nnodes", "2",
       "--nproc-per-node", "2", "--gpus", "2", "--image", "registry.local/ml/train:1", "--run-dir", "out/ddp"]


def _pod(index: int, phase: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"ddp-{index}-abcde", "namespace": "default",
                         "labels": {"disttrain.io/job": "ddp"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                         "ownerReferences": [{"kind": "Job", "name": "ddp"}]},
            "spec": {"containers": [{"name": "trainer"}]}, "status": {"phase": phase}}


@pytest.fixture
def pods(cli: Any, workdir: Path, fake_api: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Job ddp applied, two Running pods; pod i's filesystem holds ranks 2i and 2i+1's files."""
    assert cli("k8s", "apply", *JOB).code == 0
    src = workdir / "written"
    write_schema_run(src, world=4, slow=1, finished=False, done=False)
    for i in (0, 1):
        fake_api.state.put(_pod(i, "Running"))
        live = workdir / "pods" / f"ddp-{i}-abcde" / "out" / "ddp" / "live"
        live.mkdir(parents=True)
        for rank in (2 * i, 2 * i + 1):
            shutil.copy(src / "live" / f"rank-{rank}.json", live)
    shutil.copy(src / "live" / "straggler.json", workdir / "pods" / "ddp-0-abcde" / "out/ddp/live")

    def exec_read(self: Cluster, namespace: str, pod: str, container: str | None,
                  command: list[str], timeout_s: float = 30.0) -> str:
        assert (namespace, container) == ("default", "trainer")
        return subprocess.run(command, cwd=workdir / "pods" / pod, capture_output=True, text=True,
                              timeout=timeout_s, check=True).stdout

    monkeypatch.setattr(Cluster, "exec_read", exec_read)
    return workdir / "pods"


def test_once_shows_every_rank_of_every_pod_and_the_straggler(cli: Any, pods: Path) -> None:
    result = cli("k8s", "top", "ddp", "--once", "--timeout", "5")
    assert result.code == 0, result.err
    ranks = [line.split()[0] for line in result.out.splitlines()
             if line.split() and line.split()[0].isdigit()]
    assert ranks == ["0", "1", "2", "3"], result.out
    assert "rank 1 (host job-0, cuda:1) is the straggler" in " ".join(result.out.split())


def test_ended_pods_end_the_view_and_no_pods_is_a_cluster_error(cli: Any, pods: Path,
                                                                fake_api: FakeApiServer) -> None:
    for i in (0, 1):
        fake_api.state.put(_pod(i, "Succeeded"))
    result = cli("k8s", "top", "ddp", "--timeout", "5")
    assert result.code == 0 and "pods ended" in result.out, result.out + result.err
    result = cli("k8s", "top", "other", "--timeout", "1")
    assert result.code == 1 and "no pods of disttrain job 'other'" in result.err
