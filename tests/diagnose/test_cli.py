"""`disttrain doctor [logs]`, `lint`, `env` as a user runs them: exit codes, JSON, errors."""

from __future__ import annotations

import json
import socket
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner

from disttrain.cli.main import cli
from disttrain.diagnose import preflight

HERE = Path(__file__).parent
LOGS, SCRIPTS = HERE / "logs", HERE / "scripts"


def run(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(cli, list(args), input=stdin, catch_exceptions=False)


def assert_bad_input(result: Any, *words: str) -> None:
    """Bad input: exit 2, exactly one `error:` line naming the problem, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output + result.stderr
    for w in words:
        assert w in lines[0]


# -- doctor logs ---------------------------------------------------------------------------
def test_logs_json_shape_and_exit_1() -> None:
    r = run("doctor", "logs", "--json", str(LOGS / "cuda_oom_then_watchdog.log"))
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert list(data) == ["cause", "title", "rank", "host", "evidence", "fix", "consequences",
                          "confidence", "confidence_evidence", "alternative"]
    assert (data["cause"], data["rank"], data["consequences"]) == (
        "cuda_oom", 1, ["collective_timeout"])


def test_logs_clean_run_exit_0() -> None:
    r = run("doctor", "logs", str(LOGS / "none_disttrain_run.log"))
    assert r.exit_code == 0 and r.stdout.startswith("cause: none")


def test_logs_unknown_exits_1() -> None:
    assert run("doctor", "logs", str(LOGS / "unknown_unrelated.log")).exit_code == 1


def test_logs_from_stdin() -> None:
    text = (LOGS / "worker_killed_sigkill.log").read_text()
    r = run("doctor", "logs", "-", stdin=text)
    assert r.exit_code == 1 and "cause: worker_killed" in r.stdout and "rank 1" in r.stdout


def test_logs_missing_file(tmp_path: Path) -> None:
    assert_bad_input(run("doctor", "logs", str(tmp_path / "nope.log")), "nope.log",
                     "no such file")


def test_logs_directory(tmp_path: Path) -> None:
    assert_bad_input(run("doctor", "logs", str(tmp_path)), "directory")


def test_logs_needs_exactly_one_source() -> None:
    assert_bad_input(run("doctor", "logs"), "exactly one")
    assert_bad_input(run("doctor", "logs", "a.log", "--pod", "p"), "exactly one")


class FakeCluster:
    """Stands in for disttrain.k8s.client.Cluster: two pods, rank 1 raised."""

    calls: ClassVar[list[tuple[str, ...]]] = []

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> Any:
        return cls()

    def pod_log(self, namespace: str, pod: str, container: str | None, follow: bool) -> Any:
        FakeCluster.calls.append(("pod_log", namespace, pod))
        yield from (LOGS / "user_code_error_gloo.log").read_text().splitlines()

    def logs(self, namespace: str, name: str, *, follow: bool, out: Any) -> list[Any]:
        FakeCluster.calls.append(("logs", namespace, name))
        log = types.SimpleNamespace
        return [log(pod="job-0", prefix="[rank 0 job-0]", failed=True,
                    text="[rank0]: RuntimeError: Connection closed by peer [10.0.0.2]:1"),
                log(pod="job-1", prefix="[rank 1 job-1]", failed=True,
                    text="[rank1]: torch.OutOfMemoryError: CUDA out of memory.")]


def test_logs_from_pod_and_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.k8s import client as kube

    monkeypatch.setattr(kube, "Cluster", FakeCluster)
    FakeCluster.calls.clear()
    r = run("doctor", "logs", "--pod", "trainer-0", "-n", "ml", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["cause"] == "user_code_error"
    r = run("doctor", "logs", "--job", "mnist", "--json")
    data = json.loads(r.stdout)
    assert (data["cause"], data["rank"], data["host"]) == ("cuda_oom", 1, "job-1")
    assert FakeCluster.calls == [("pod_log", "ml", "trainer-0"), ("logs", "default", "mnist")]


def test_logs_pod_without_a_log_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.k8s import client as kube

    monkeypatch.delattr(kube, "Cluster")
    assert_bad_input(run("doctor", "logs", "--pod", "x"), "kubectl logs")


def test_logs_cluster_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.k8s import client as kube

    def boom(*a: Any, **k: Any) -> Any:
        raise kube.KubeError("kubeconfig /x: connection refused")

    monkeypatch.setattr(kube.Cluster, "from_kubeconfig", classmethod(boom))
    assert_bad_input(run("doctor", "logs", "--job", "j"), "connection refused")


# -- doctor (preflight) ----------------------------------------------------------------------
def test_doctor_taken_port_fails_with_json() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run("doctor", "--json", "--master-addr", "127.0.0.1", "--master-port", str(port))
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["ok"] is False
    checks = {c["check"]: c for c in data["checks"]}
    assert set(checks["torch"]) == {"check", "status", "detail", "fix"}
    assert checks["master_port"]["status"] == "fail"
    assert str(port) in checks["master_port"]["detail"]


def test_doctor_all_ok_exits_0(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = [preflight.Check("torch", "ok", "fine"), preflight.Check("shm", "warn", "small", "grow")]
    monkeypatch.setattr(preflight, "run_checks", lambda probe: ok)
    r = run("doctor")
    assert r.exit_code == 0
    assert "torch" in r.stdout and "1 ok, 1 warn, 0 fail" in r.stdout


def test_doctor_bad_flag_is_usage_error() -> None:
    r = run("doctor", "--master-port", "99999")
    assert r.exit_code == 2 and "Traceback" not in r.output


# -- lint -------------------------------------------------------------------------------------
def test_lint_json_shape_and_exit_1() -> None:
    r = run("lint", "--format", "json", str(SCRIPTS / "seed_002_spawn.py"))
    assert r.exit_code == 1
    data = json.loads(r.stdout)["findings"]
    assert {tuple(d) for d in data} == {("rule", "path", "line", "message", "fix")}
    assert [d["rule"] for d in data] == ["DT018", "DT007", "DT005"]


def test_lint_clean_exit_0() -> None:
    r = run("lint", str(SCRIPTS / "clean_ddp.py"))
    assert r.exit_code == 0 and "no findings" in r.stdout


def test_lint_text_output() -> None:
    r = run("lint", str(SCRIPTS / "seed_000_s4_dataparallel.py"))
    assert r.exit_code == 1
    assert "seed_000_s4_dataparallel.py:10: DT001 " in r.stdout and "    fix: " in r.stdout


def test_lint_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef f(:\n    pass\n")
    assert_bad_input(run("lint", str(bad)), "bad.py:3", "cannot parse")


def test_lint_unreadable(tmp_path: Path) -> None:
    assert_bad_input(run("lint", str(tmp_path / "missing.py")), "missing.py", "no such file")
    binary = tmp_path / "blob.py"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_bad_input(run("lint", str(binary)), "blob.py")


def test_lint_needs_a_script_and_known_rules() -> None:
    assert_bad_input(run("lint"), "SCRIPT")
    assert_bad_input(run("lint", "--select", "DT999", str(SCRIPTS / "clean_ddp.py")), "DT999")


def test_lint_select_and_ignore() -> None:
    path = str(SCRIPTS / "seed_002_spawn.py")
    r = run("lint", "--json", "--select", "dt005", path)
    assert [d["rule"] for d in json.loads(r.stdout)["findings"]] == ["DT005"]
    r = run("lint", "--json", "--ignore", "DT005,DT007,DT018", path)
    assert r.exit_code == 0 and json.loads(r.stdout)["findings"] == []


def test_lint_list_rules() -> None:
    r = run("lint", "--list-rules")
    assert r.exit_code == 0
    assert [line.split()[0] for line in r.stdout.splitlines()][:10] == [
        f"DT{i:03d}" for i in range(1, 11)]


def test_lint_shell_script_launch(tmp_path: Path) -> None:
    sh = tmp_path / "run.sh"
    sh.write_text("#!/bin/sh\n# python -m torch.distributed.launch in a comment is fine\n"
                  "python -m torch.distributed.launch --nproc_per_node=2 train.py\n")
    r = run("lint", "--format", "json", str(sh))
    assert [(d["rule"], d["line"]) for d in json.loads(r.stdout)["findings"]] == [("DT008", 3)]


# -- env --------------------------------------------------------------------------------------
def test_env_json_masks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    r = run("env", "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["env"]["HF_TOKEN"] == "****" and data["env"]["NCCL_DEBUG"] == "INFO"
    assert "hf_secretvalue" not in r.stdout
    assert isinstance(data["distributed_available"], bool)


def test_env_text_and_gpus_without_gpu() -> None:
    r = run("env", "--gpus")
    assert r.exit_code == 0
    assert "torch.distributed.is_available(): True" in r.stdout
    assert "## GPUs (NVML)" in r.stdout
