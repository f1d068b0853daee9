"""run-local of the multi-pod kinds on emulated hosts (needs root and ip netns): the task of
tests/k8s/data/task trained as an Indexed Job (one shared reference run), then as a JobSet
and a TrainJob to the same params_sha256 (same topology: 2 pods × 1 rank, gloo); and a job
one of whose pods never starts, which ends at its rendezvous deadline naming that pod."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_local import TASK_DATA, _leftovers, netns

RDZV_S = 10  # the least launch.rdzv_timeout_s takes
RUN = [sys.executable, "-m", "disttrain.cli.main", "k8s", "run-local"]


@dataclass
class Run:
    code: int
    out: str
    err: str
    run_dir: Path
    tag: str  # run-local's namespace prefix (dt<pid>)

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def _run_local(cwd: Path, *flags: str, timeout_s: float) -> Run:
    """`disttrain k8s run-local` in a child process (its own pid: its own netns tag)."""
    run_dir = cwd / "run"
    proc = subprocess.Popen([*RUN, *flags, "--run-dir", str(run_dir)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Run(proc.returncode, out, err, run_dir, f"dt{proc.pid}")


def _task_run(base: Path, kind: str) -> Run:
    shutil.copytree(TASK_DATA, base, dirs_exist_ok=True)
    return _run_local(base, "-f", "job.yaml", "--kind", kind, "--gpus", "0", "--backend",
                      "gloo", "--timeout", "400", timeout_s=480)


@pytest.fixture(scope="module")
def task_job(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: the task as a 2-pod Indexed Job."""
    return _task_run(tmp_path_factory.mktemp("job"), "job")


@netns
@pytest.mark.netns
@pytest.mark.timeout(600)
def test_run_local_trains_a_task_from_its_shipped_code(task_job: Run) -> None:
    """tests/k8s/data/task as a 2-pod Indexed Job: every pod imports the ConfigMap's copy
    of the task (not the folder it was rendered from) and the ranks end in sync."""
    assert task_job.code == 0, task_job.out[-3000:] + task_job.err[-3000:]
    imported = {line.split("task module: ")[1] for line in task_job.out.splitlines()
                if "task module: " in line}
    assert len(imported) == 2, task_job.out[-3000:]  # one copy per pod
    assert all("disttrain-run-local-" in path and not path.startswith(str(task_job.run_dir.parent))
               for path in imported)
    summary = task_job.summary
    assert summary["world_size"] == 2 and summary["epochs"] == 3
    assert summary["params_in_sync"] is True
    assert _leftovers(task_job.tag) == []


@netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["jobset", "trainjob"])
def test_jobset_and_trainjob_train_the_task_like_a_job(kind: str, task_job: Run,
                                                       tmp_path: Path) -> None:
    """JobSet (c10d at `<job>-node-0-0.<job>`) and TrainJob (static rendezvous from the
    PET_* env Trainer injects) end at the Indexed Job's parameters, bit for bit."""
    assert task_job.code == 0, task_job.err[-3000:]
    run = _task_run(tmp_path, kind)
    assert run.code == 0, run.out[-3000:] + run.err[-3000:]
    assert "[mytask-node-0-0]" in run.out and "[mytask-node-0-1]" in run.out
    assert run.summary["world_size"] == 2
    assert run.summary["params_sha256"] == task_job.summary["params_sha256"]
    assert _leftovers(run.tag) == []


@netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["jobset", "trainjob"])  # c10d join_timeout / static store
def test_a_pod_that_never_starts_ends_the_job_at_the_deadline(kind: str, tmp_path: Path) -> None:
    """Pod 1 is never placed: pod 0's ranks wait in torchrun's own rendezvous until
    --rdzv-timeout-s, exit, and run-local names the missing pod. run-local's --timeout
    (deadline + 30 s) is the bound: past it the run would end as timed out (124)."""
    (tmp_path / "meet.py").write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "print('met', dist.get_rank(), flush=True)\n")
    run = _run_local(tmp_path, "meet.py", "--name", "meet", "--kind", kind, "--nnodes", "2",
                     "--nproc-per-node", "1", "--gpus", "0", "--backend", "gloo",
                     "--rdzv-timeout-s", str(RDZV_S), "--unschedulable", "meet-node-0-1",
                     "--timeout", str(RDZV_S + 30), timeout_s=RDZV_S + 120)
    assert run.code == 1, run.out[-3000:] + run.err[-3000:]  # not 124: the deadline ended it
    assert "run-local stopped after --timeout" not in run.err
    assert "met 0" not in run.out and "[meet-node-0-1]" not in run.out
    assert run.err.rstrip().splitlines()[-1] == (
        "error: 1 of 2 ranks arrived; missing: pod meet-node-0-1 (Pending: 0/1 nodes are "
        "available: run-local --unschedulable meet-node-0-1 (the emulated scheduler found "
        "no room))")
    assert _leftovers(run.tag) == []
    leaked = subprocess.run(["pgrep", "-f", "disttrain-run-local-.*meet[.]py"],
                            capture_output=True, text=True, check=False).stdout.split()
    assert leaked == []
