"""run-local: the rendered pods as processes in network namespaces.

The pure parts (env, $(VAR) expansion, hosts, addresses, paths) run everywhere; the
`netns` tests need root and iproute2 and train for real across 2 emulated hosts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.conftest import left_in, sigint_default
from tests.fixtures.hosts import needs_netns

from disttrain.k8s import local
from disttrain.k8s import netns as hostnet
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec

TASK_DATA = Path(__file__).parent / "data" / "task"
netns = needs_netns


def _job_spec(**launch: Any) -> JobSpec:
    return JobSpec.from_dict({"launch": {"nnodes": 2, "nproc_per_node": 1, **launch},
                              "cluster": {"kind": "job"}})


def test_expand_follows_kubelet_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert local.expand("--x=$(A)-$(B)", env) == "--x=1-two"
    assert local.expand("$(MISSING)", env) == "$(MISSING)"
    assert local.expand("$$(A) $$", env) == "$(A) $"


def test_addresses_come_only_from_198_18_0_0_15() -> None:
    block = ipaddress.ip_network("198.18.0.0/15")
    addrs = [ipaddress.ip_address(hostnet.pod_address(i)) for i in range(254)]
    assert all(a in block for a in addrs) and len(set(addrs)) == 254
    with pytest.raises(local.LocalRunError):
        hostnet.pod_address(254)


def test_job_pods_get_their_index_and_names(workdir: Path) -> None:
    spec = _job_spec()
    objects = render(spec, workdir, local=True).objects
    pods = local.local_pods(objects, spec)
    assert [p.name for p in pods] == ["disttrain-0", "disttrain-1"]
    p1 = pods[1]
    assert p1.env["JOB_COMPLETION_INDEX"] == "1"
    assert "--node_rank=1" in p1.argv  # $(JOB_COMPLETION_INDEX) expanded like kubelet does
    assert "--rdzv_endpoint=disttrain-0.disttrain:29500" in p1.argv
    assert p1.aliases == ("disttrain-1.disttrain.default.svc.cluster.local",
                          "disttrain-1.disttrain", "disttrain-1")
    hosts = hostnet.hosts_file(pods)
    assert "198.18.0.1\tdisttrain-0.disttrain.default.svc.cluster.local disttrain-0.disttrain " \
           "disttrain-0\n" in hosts
    assert hosts.startswith("127.0.0.1\tlocalhost\n")


def test_pytorchjob_pods_get_the_operator_env(workdir: Path) -> None:
    spec = JobSpec.from_dict({"script": "train.py", "launch": {"nnodes": 3},
                              "cluster": {"kind": "pytorchjob", "gpus": 2}})
    pods = local.local_pods(render(spec, workdir, local=True).objects, spec)
    assert [p.name for p in pods] == ["train-master-0", "train-worker-0",  # named after train.py
                                      "train-worker-1"]
    assert pods[2].env["PET_NODE_RANK"] == "2" and pods[2].env["PET_NNODES"] == "3"
    assert pods[0].env["PET_MASTER_ADDR"] == "train-master-0"
    assert pods[1].env["WORLD_SIZE"] == "6"


def test_paths_map_to_local_folders() -> None:
    mapping = {"/workspace": "/tmp/w", "/workspace/data": "/tmp/d"}
    assert local.map_path("/workspace/train.py", mapping) == "/tmp/w/train.py"
    assert local.map_path("/workspace/data/x", mapping) == "/tmp/d/x"
    assert local.map_path("--spec=/workspace/j.yaml", mapping) == "--spec=/tmp/w/j.yaml"
    assert local.map_path("/workspaces", mapping) == "/workspaces"
    assert local.map_path("train.py", mapping) == "train.py"


def test_a_pods_task_dir_is_the_local_folder_of_its_code_mount(workdir: Path, tmp_path: Path) -> None:
    """The shipped job.yaml says task_dir: /workspace, the container's path; run-local
    points it at the folder that stands in for that mount, where the shipped files are."""
    shutil.copytree(TASK_DATA, workdir, dirs_exist_ok=True)
    spec = local.local_spec(JobSpec.from_dict({
        "task": "mytask:make_task", "task_dir": str(workdir),
        "launch": {"nnodes": 2, "nproc_per_node": 1}, "cluster": {"kind": "job"}}), workdir)
    objects = render(spec, workdir, local=True).objects
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    pod = local.local_pods(objects, spec)[1]
    mapping = local._Files(tmp_path / "root", configmaps).prepare(pod)
    shipped = yaml.safe_load(Path(mapping["/etc/disttrain/job.yaml"]).read_text())
    code = Path(shipped["task_dir"])
    assert code == Path(mapping["/workspace"]) and code != workdir
    for rel in ("mytask.py", "helpers.py", "blocks/mlp.py"):
        assert (code / rel).read_bytes() == (workdir / rel).read_bytes()
    assert not (code / "unrelated.py").exists()
    assert JobSpec.from_dict(shipped).task == "mytask:make_task"


def test_without_root_it_says_why(cli: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = cli("k8s", "run-local", "--kind", "job", "--nnodes", "2")
    assert result.code == 2 and "needs root" in result.err and "Traceback" not in result.err


def test_without_ip_it_says_why(cli: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else real(tool))
    result = cli("k8s", "run-local", "--kind", "job", "--nnodes", "2")
    assert result.code == 2 and "`ip` (iproute2)" in result.err


def _leftovers(tag: str = "dt") -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=False).stdout.split()
    ours = [n for n in names if n.startswith(tag) and "-" in n]
    etc = Path("/etc/netns")
    return ours + ([p.name for p in etc.iterdir() if p.name.startswith(tag)] if etc.is_dir()
                   else [])


@netns
@pytest.mark.netns
@pytest.mark.timeout(600)
def test_run_local_trains_the_default_job_on_two_emulated_hosts(two_host_reference: Path) -> None:
    """The session's undisturbed 2-host run (tests/conftest.py TWO_HOST_JOB, one rank per
    emulated host, one epoch of digits), which the fault tests of
    tests/resilience/test_hosts.py compare with: both pods trained one model together, ended
    in sync, removed their namespaces (checked where it is made), and learned: 0.89 test
    accuracy after its one epoch here, chance being 0.10 (the local default job's 0.95 after
    10 epochs is tests/cli/test_run_cli.py's)."""
    out = (two_host_reference.parent / "run-local.out").read_text()
    assert "[disttrain-0]" in out and "[disttrain-1]" in out
    assert "run-local: all 2 pods succeeded" in out
    summary = json.loads((two_host_reference / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params_in_sync"] is True
    assert summary["test_accuracy"] >= 0.85, summary["test_accuracy"]
    ranks = json.loads((two_host_reference / "ranks.json").read_text())
    assert {(r["rank"], r["host"]) for r in ranks["ranks"]} == {(0, "disttrain-0"),
                                                                (1, "disttrain-1")}


@netns
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_emulated_pods_reach_each_other_and_nothing_else(workdir: Path) -> None:
    spec = _job_spec()
    pods = local.local_pods(render(spec, workdir, local=True).objects, spec)
    probe = ("import socket, sys\n"
             "print(socket.gethostname(), socket.gethostbyname(sys.argv[1]))\n"
             "s = socket.socket(); s.settimeout(2)\n"
             "try:\n    s.connect(('1.1.1.1', 53)); print('REACHED')\n"
             "except OSError as e:\n    print('blocked', e.errno)\n")
    with hostnet.network(pods, f"dt{os.getpid()}t") as names:
        routes = subprocess.run(["ip", "-n", names["disttrain-1"], "-4", "route"],
                                capture_output=True, text=True, check=True).stdout
        assert routes.split()[0] == "198.18.0.0/24" and "default" not in routes
        out = subprocess.run(
            ["ip", "netns", "exec", names["disttrain-1"], "unshare", "--uts", "--", "sh", "-c",
             'hostname disttrain-1 && exec "$@"', "sh", sys.executable, "-c", probe,
             "disttrain-0.disttrain"], capture_output=True, text=True, timeout=60, check=True)
        host, addr, *rest = out.stdout.split()
        assert (host, addr) == ("disttrain-1", "198.18.0.1")
        assert rest[0] == "blocked" and "REACHED" not in out.stdout
    assert _leftovers(f"dt{os.getpid()}t") == []


@netns
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_failed_pods_are_reported_and_everything_is_removed(cli: Any, workdir: Path,
                                                           private_tmpdir: Path) -> None:
    """Everything: the namespaces, and the pods' temp files (each pod has its own TMPDIR,
    as a container has its own /tmp: torchrun would leave a torchelastic_* folder)."""
    (workdir / "fail.py").write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    result = cli("k8s", "run-local", "fail.py", "--kind", "job", "--nnodes", "2",
                 "--nproc-per-node", "1", "--backend", "gloo", "--timeout", "240")
    assert result.code != 0
    assert "[fail-0] about to fail" in result.out   # the job is named after fail.py
    assert "error: pod fail-0 failed" in result.err
    assert _leftovers(f"dt{os.getpid()}") == []
    assert left_in(private_tmpdir) == []


SLEEP_PODS = "disttrain-run-local-.*sleep[.]py"   # test_interrupt's pods, by command line


def _sigint_state(pid: int) -> str:
    """Whether `pid` ignores, blocks, catches or has pending SIGINT (/proc), and where it
    waits: what a Ctrl-C that ended nothing needs explained."""
    try:
        status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as exc:
        return f"pid {pid}: {exc}"
    bit = 1 << (signal.SIGINT - 1)
    flags = {k: bool(int(status[k], 16) & bit) for k in ("SigIgn", "SigBlk", "SigCgt", "SigPnd", "ShdPnd")}
    return f"pid {pid} state {status.get('State', '?').strip()}, wchan {wchan}, SIGINT {flags}"


@netns
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_interrupt_removes_everything(workdir: Path) -> None:
    (workdir / "sleep.py").write_text("import time\nprint('sleeping', flush=True)\n"
                                      "time.sleep(600)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain.cli.main", "k8s", "run-local", "sleep.py", "--kind",
         "job", "--nnodes", "2", "--nproc-per-node", "1", "--backend", "gloo"],
        cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=sigint_default)
    tag = f"dt{proc.pid}"
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until both pods run
            lines.append(line)
            if "sleeping" in line and "[sleep-1]" in line:  # named after sleep.py
                break
        # the rest of its output is read as it comes: a full pipe could block its cleanup
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        assert len([n for n in _leftovers(tag) if n.startswith(tag)]) >= 3
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run-local did not end within 60 s of SIGINT: {_sigint_state(proc.pid)}"
                        f"\n{''.join(lines)[-3000:]}")
        assert code == 130, "".join(lines)[-3000:]
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            # its pods are sessions of their own: nothing else would end them
            subprocess.run(["pkill", "-KILL", "-f", SLEEP_PODS], check=False)
    assert _leftovers(tag) == []
    time.sleep(0.5)
    leaked = subprocess.run(["pgrep", "-f", SLEEP_PODS],
                            capture_output=True, text=True, check=False).stdout.split()
    assert leaked == []


def test_failed_pods_come_back_as_their_workload_would(workdir: Path) -> None:
    """backoffLimit of a Job, runPolicy.backoffLimit of a PyTorchJob that restarts on
    failure, none for a bare Pod; a re-created Job pod's agent rejoins with torch's
    shared rendezvous store off (docs/resilience.md, "Hosts lost and partitions")."""
    def objects(kind: str, restarts: int) -> list[dict[str, Any]]:
        spec = JobSpec.from_dict({"launch": {"nnodes": 1 if kind == "pod" else 2,
                                             "max_restarts": restarts},
                                  "cluster": {"kind": kind}})
        return render(spec, workdir, local=True).objects

    assert local.backoff_limit(objects("job", 2)) == 2
    assert local.backoff_limit(objects("job", 0)) == 0
    assert local.backoff_limit(objects("pytorchjob", 1)) == 1
    assert local.backoff_limit(objects("pod", 0)) == 0

    def rdzv_env(restarts: int) -> dict[str, str]:
        job = next(o for o in objects("job", restarts) if o["kind"] == "Job")
        ctr = job["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in ctr["env"]}

    assert rdzv_env(1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in rdzv_env(0)


def test_run_locals_timeout_is_not_the_jobs_timeout_s(cli: Any, workdir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--timeout` (how long run-local lets the pods run) and `--timeout-s` (the job's
    stall timeout) once shared one parameter name, and the pods got the default 300 s."""
    seen: dict[str, Any] = {}

    def fake_run(spec: JobSpec, base_dir: Path, *, out: Any, timeout_s: float | None):
        seen.update(spec_timeout=spec.launch.timeout_s, run_timeout=timeout_s)
        return local.LocalResult({"disttrain-0": 0, "disttrain-1": 0})

    monkeypatch.setattr(local, "check_host", lambda: None)
    monkeypatch.setattr(local, "run_local", fake_run)
    result = cli("k8s", "run-local", "--kind", "job", "--nnodes", "2", "--timeout-s", "15",
                 "--timeout", "240")
    assert result.code == 0, result.err
    assert seen == {"spec_timeout": 15.0, "run_timeout": 240.0}
