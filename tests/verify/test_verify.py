"""`disttrain verify`: passes on 2 real gloo ranks, and catches every injected fault at the
right check and rank (text and JSON), with no check failing that was not broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from disttrain.cli import k8s_verify_cmd as cmd
from disttrain.cli.verify_cmd import print_report
from disttrain.cli.verify_cmd import verify as verify_cli
from disttrain.k8s import render
from disttrain.spec.job import JobSpec
from disttrain.verify import runner as verify
from disttrain.verify import verify_checks
from disttrain.verify.runner import CHECKS, CheckResult, parse_faults, parse_verdict, verify_local
from tests.conftest import ABORT_AT_EXIT

pytestmark = pytest.mark.timeout(150)
LAUNCH = {"nproc_per_node": 2, "timeout_s": 60, "master_port": 0, "backend": "gloo"}
# Two runs break every check, each on one rank, the rank alternating between the runs
# (consistency and gradient_sync are judged against rank 0: break rank 1 in both).
SELF_JUDGED = [c for c in CHECKS if c not in ("consistency", "gradient_sync")]
FAULTS_A = {c: i % 2 for i, c in enumerate(SELF_JUDGED)} | {"consistency": 1, "gradient_sync": 1}
FAULTS_B = {c: 1 - r for c, r in FAULTS_A.items()} | {"consistency": 1, "gradient_sync": 1}


def _fault_text(faults: dict[str, int]) -> str:
    return ",".join(f"{c}:{r}" for c, r in faults.items())


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[CheckResult], int]]:
    spec = JobSpec.from_dict({}, LAUNCH)
    return {"clean": verify_local(spec),
            "A": verify_local(spec, fault=_fault_text(FAULTS_A)),
            "B": verify_local(spec, fault=_fault_text(FAULTS_B))}


def test_passes_on_two_gloo_ranks(runs):
    results, code = runs["clean"]
    assert code == 0
    assert {(r.check, r.rank) for r in results} == {(c, r) for c in CHECKS for r in (0, 1)}
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert {r.backend for r in results} == {"gloo"} and {r.device for r in results} == {"cpu"}
    conv = [r.detail for r in results if r.check == "convergence"]
    assert all("must fall by 30%" in d for d in conv)


@pytest.mark.parametrize("check", CHECKS)
def test_each_fault_is_caught_at_its_check_and_rank(runs, check):
    for name, faults in (("A", FAULTS_A), ("B", FAULTS_B)):
        results, code = runs[name]
        assert code == 1
        row = {r.rank: r for r in results if r.check == check}
        bad = faults[check]
        assert not row[bad].ok, f"run {name}: {check} on rank {bad} not caught: {row[bad].detail}"
        assert row[1 - bad].ok, f"run {name}: {check} on rank {1 - bad} falsely failed: {row[1 - bad].detail}"


def test_cli_json_names_failed_check_and_rank():
    res = CliRunner().invoke(verify_cli, ["--json", "--nproc-per-node", "2", "--backend", "gloo",
                                          "--timeout-s", "60", "--master-port", "0",
                                          "--fault", "gradient_sync:1"])
    assert res.exit_code == 1, res.output
    objs = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    checks = [o for o in objs if "check" in o]
    assert len(checks) == 2 * len(CHECKS)
    assert all(set(o) >= {"check", "rank", "ok", "detail"} for o in checks)
    final = objs[-1]
    assert final["verdict"] == "fail" and final["ok"] is False
    assert [(f["check"], f["rank"]) for f in final["failed"]] == [("gradient_sync", 1)]


def test_cli_text_report_and_exit_codes(capsys):
    results = [CheckResult(c, r, not (c == "all_reduce_sum" and r == 1), "detail", 0.01, "h", r,
                           "cpu", "gloo") for c in CHECKS for r in (0, 1)]
    print_report(results)
    out = capsys.readouterr().out
    assert "local rank" in out and "rank 1" in out
    assert "FAIL all_reduce_sum on rank 1: detail" in out
    assert "verdict: FAIL: 10 checks on 2 ranks, 1 failed" in out
    bad = CliRunner().invoke(verify_cli, ["--fault", "nonsense:1", "--master-port", "0"])
    assert bad.exit_code == 2 and "error:" in bad.output and "nonsense:1" in bad.output
    spawn = CliRunner().invoke(verify_cli, ["--launcher", "spawn"])
    assert spawn.exit_code == 2 and "torchrun" in spawn.output


def test_file_alone_under_torchrun_without_disttrain(tmp_path):
    """What `k8s verify` runs in a pod with torch only: the file as a torchrun script."""
    blocker = tmp_path / "block" / "disttrain"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('disttrain is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "OMP_NUM_THREADS": "1",
           verify.FAULT_ENV: "broadcast:1", "TMPDIR": str(tmp_path)}   # torchrun's folder
    env.pop("DISTTRAIN_T0", None)
    script = Path(verify_checks.__file__)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "--rdzv-conf", "timeout=60", str(script), "--json",
                          "--backend", "gloo", "--timeout-s", "60"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode != 0  # the broken check fails the job, as a pod's status shows
    results, final = parse_verdict(res.stdout)
    assert final is not None, res.stderr[-2000:]
    assert [(f["check"], f["rank"]) for f in final["failed"]] == [("broadcast", 1)]
    assert len(results) == 2 * len(CHECKS)


# -- pure pieces ------------------------------------------------------------------------
def test_parse_faults():
    assert parse_faults("barrier:1, convergence:0,barrier:0") == {"barrier": {0, 1}, "convergence": {0}}
    assert parse_faults(None) == {} and parse_faults("") == {}
    for bad in ("barrier", "nope:1", "barrier:x"):
        with pytest.raises(ValueError, match="DISTTRAIN_VERIFY_FAULT"):
            parse_faults(bad)


def test_reference_is_rank0_unless_a_majority_disagrees():
    assert verify_checks._reference(["a", "b"]) == (0, "a")
    assert verify_checks._reference(["b", "a", "a"]) == (1, "a")
    assert verify_checks._reference(["a", "b", "c"]) == (0, "a")


def test_parse_verdict_tolerates_prefixes_and_noise():
    results = [CheckResult("barrier", r, r == 0, "x") for r in (0, 1)]
    log = "\n".join(["starting", *("[rank0]:" + line for line in verify.json_lines(results)), "{bad"])
    got, final = parse_verdict(log)
    assert [(r.check, r.rank, r.ok) for r in got] == [("barrier", 0, True), ("barrier", 1, False)]
    assert final == verify.verdict(results) and final["failed"][0]["rank"] == 1


def test_verify_job_spec_ships_this_file_in_a_configmap():
    spec = JobSpec.from_dict({"name": "mnist-ddp", "example": "mnist",
                              "cluster": {"image": "reg/pytorch:2.1.0", "gpus": 2,
                                          "code": {"host_path": "/opt/code"}}},
                             {"backend": "nccl", "max_restarts": 2})
    v = verify.verify_job_spec(spec)
    assert v.name == "mnist-ddp-verify" and v.task is None and v.task_args == {} and v.script
    assert Path(v.script).name == "verify_checks.py" and Path(v.script).is_file()
    assert v.args[:3] == ["--json", "--backend", "nccl"] and v.launch.max_restarts == 0
    assert v.cluster.code.configmap and v.cluster.code.host_path is None
    assert v.cluster.image == "reg/pytorch:2.1.0" and v.cluster.gpus == 2
    assert not v.cluster.image_has_disttrain and v.cluster.install_disttrain is None
    long = verify.verify_job_spec(spec.model_copy(update={"name": "a" * 63}))
    assert len(long.name) <= 63


def test_verify_job_spec_renders_without_disttrain_in_the_image():
    spec = JobSpec.from_dict({"cluster": {"image": "reg/pytorch:2.1.0"}})
    rendered = render.render(verify.verify_job_spec(spec), base_dir=Path.cwd())
    text = json.dumps(rendered.objects)
    assert "verify_checks.py" in text and "disttrain.worker" not in text


class _FakeCluster:
    """The three Cluster verbs verify_on_cluster uses; the pod 'prints' canned JSON lines."""

    def __init__(self, log_text: str, failed: bool = False):
        self.calls: list[tuple[str, str]] = []
        self.applied: list[dict] = []
        self.log_text, self.failed = log_text, failed

    def delete_job(self, ns, name):
        from disttrain.errors import KubeError

        self.calls.append(("delete", name))
        if len(self.calls) == 1:
            raise KubeError("no such job")
        return []

    def apply(self, objects):
        self.calls.append(("apply", objects[-1]["metadata"]["name"]))
        self.applied = objects

    def logs(self, ns, name, *, follow, out):
        from disttrain.k8s.client import PodLog

        self.calls.append(("logs", name))
        for line in ["starting", *self.log_text.splitlines()]:
            out(line)
        return [PodLog(f"{name}", "[rank 0]", self.log_text, self.failed)]


def test_verify_on_cluster_applies_follows_and_reads_the_verdict():
    spec = JobSpec.from_dict({"name": "ddp", "cluster": {"image": "reg/pytorch:2.1.0"}})
    results = [CheckResult(c, r, not (c == "barrier" and r == 1), "d") for c in CHECKS for r in (0, 1)]
    cluster, shown = _FakeCluster("\n".join(verify.json_lines(results))), []
    got, code = verify.verify_on_cluster(spec, cluster, out=shown.append)
    assert code == 1 and [(r.check, r.rank) for r in got if not r.ok] == [("barrier", 1)]
    assert [c[0] for c in cluster.calls] == ["delete", "apply", "logs", "delete"]
    assert shown == ["starting"], "check JSON lines are not echoed raw"
    cm = next(o for o in cluster.applied if o["kind"] == "ConfigMap")
    assert "def run_checks" in cm["data"]["verify_checks.py"]
    crashed, code = verify.verify_on_cluster(spec, _FakeCluster("Traceback ...", failed=True),
                                             out=shown.append)
    assert code == 1 and crashed[-1].check == "launch" and "ddp-verify" in crashed[-1].detail


def test_k8s_verify_command_prints_the_cluster_verdict(monkeypatch):
    """`disttrain k8s verify` (disttrain.cli.k8s_verify_cmd) on a fake cluster."""
    from disttrain.cli import k8s_common

    results = [CheckResult(c, r, not (c == "convergence" and r == 0), "d") for c in CHECKS for r in (0, 1)]
    monkeypatch.setattr(k8s_common, "connect", lambda *a: _FakeCluster("\n".join(verify.json_lines(results))))
    res = CliRunner().invoke(cmd.verify, ["--image", "reg/pytorch:2.1.0", "--json"])
    assert res.exit_code == 1, res.output
    final = json.loads(res.output.splitlines()[-1])
    assert [(f["check"], f["rank"]) for f in final["failed"]] == [("convergence", 0)]
    bad = CliRunner().invoke(cmd.verify, ["--kind", "job", "--nnodes", "2", "--master-port", "0",
                                          "--image", "x"])
    assert bad.exit_code == 2 and "master_port" in bad.output


def test_a_verify_rank_ends_without_the_teardown_that_can_abort_it():
    """verify_checks.py (a pod's torchrun ranks) ends with its verdict's status even when the
    interpreter's teardown would abort (a C++ static destructor that aborts stands in for
    torch's: docs/resilience.md, "How a process ends"), its last line written."""
    head = (ABORT_AT_EXIT + "import sys\n"
            f"sys.path.insert(0, {str(Path(verify_checks.__file__).parent)!r})\n"
            "from verify_checks import exit_without_teardown\n"
            "print('verdict written', end='')\n")
    plain = subprocess.run([sys.executable, "-c", head + "sys.exit(3)\n"],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == -6                     # the fault: the normal exit aborts
    ended = subprocess.run([sys.executable, "-c", head + "exit_without_teardown(3)\n"],
                           capture_output=True, text=True, timeout=60)
    assert (ended.returncode, ended.stdout) == (3, "verdict written")
