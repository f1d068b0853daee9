"""Rank 0's stall watchdog under plain torchrun (the pod command), where no disttrain
launcher watches: `torchrun -m disttrain.worker --spec job.yaml`.

The multi-process tests run real gloo ranks on CPU from a subprocess with a timeout; a
SIGSTOPped rank left behind by a failed test is killed by `no_stray_workers` (conftest.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from disttrain.spec.job import JobSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.usefixtures("no_stray_workers")]
TIMEOUT_S = 6  # the job's stall timeout: collectives time out 2 s later (grace)
RUN_WAIT_S = 120  # the whole torchrun subprocess


def _plain_torchrun(cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """`torchrun --standalone --nproc_per_node=2 -m disttrain.worker` on a tiny digits job:
    (exit code, stdout + stderr, seconds). The whole process group is killed on timeout."""
    spec = JobSpec.from_dict({}, {"epochs": 1, "max_steps": 8, "timeout_s": TIMEOUT_S,
                                  "threads": 1, "checkpoint_every_epochs": 0,
                                  "run_dir": str(cwd / "run")})
    (cwd / "job.yaml").write_text(spec.to_yaml())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "disttrain.worker", "--spec", "job.yaml"]
    # TMPDIR: plain torchrun leaves a torchelastic_* folder in it per launch
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(cwd), **(env or {})}
    full_env.pop("DISTTRAIN_WATCHDOG", None)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"plain torchrun did not end within {RUN_WAIT_S} s:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def _stopped_rank_run(tmp_path: Path, stopped: int, watcher: int) -> tuple[str, int, float]:
    """SIGSTOP rank `stopped` at step 3 under plain torchrun; check that rank `watcher`
    names it once, ends the job and that the stopped process is gone. Returns the output,
    the stopped pid and the seconds the run took."""
    code, out, took = _plain_torchrun(tmp_path, {"DISTTRAIN_FAULT": f"stop:rank={stopped}:step=3"})
    found = re.search(rf"fault injection .* stop rank {stopped} pid (\d+) ", out)
    assert found, out[-4000:]
    pid = int(found.group(1))
    assert code != 0, out[-4000:]
    named = re.findall(rf"error: rank {stopped} \(pid {pid}, host \S+\) made no progress for "
                       rf"(\d+) s; last seen: step 3, phase \w+", out)
    assert len(named) == 1 and int(named[0]) >= TIMEOUT_S, out[-4000:]
    assert f"ending the job (rank {watcher} exits with code 1)" in out
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    from disttrain.diagnose.logs import diagnose

    d = diagnose(out)
    assert (d.cause, d.rank) == ("collective_timeout", stopped), d.title
    return out, pid, took


def test_stalled_rank_is_named_and_ends_the_job_without_a_launcher(tmp_path):
    out, _, took = _stopped_rank_run(tmp_path, stopped=1, watcher=0)
    # torchrun's own summary carries the cause in rank 0's recorded error: as the root
    # cause, or among the failures when the killed rank 1 is timestamped first (its
    # timestamps have 1 s resolution)
    assert re.search(r"disttrain.worker FAILED[\s\S]*RankStalled: rank 1 \(pid", out), out[-4000:]
    print(f"\nstalled plain-torchrun job ended after {took:.1f} s")


def test_stopped_rank0_is_named_by_rank1_and_ends_the_job(tmp_path):
    """Rank 0 cannot watch when its own process is stopped: rank 1's backup watch does.
    torchrun's summary blames rank 0 (killed by rank 1's watch, in the same second as
    rank 1's exit); rank 1's line, and `doctor logs`, name rank 0's stall."""
    _, _, took = _stopped_rank_run(tmp_path, stopped=0, watcher=1)
    print(f"\nplain-torchrun job with a stopped rank 0 ended after {took:.1f} s")


def test_healthy_run_exits_0_without_a_report(tmp_path):
    code, out, took = _plain_torchrun(tmp_path)
    assert code == 0, out[-4000:]
    assert "made no progress" not in out and "disttrain fault injection" not in out
    assert "parameters identical on all 2 ranks: yes" in out
    print(f"\nhealthy plain-torchrun job took {took:.1f} s")


# -- who watches (in-process, no ranks) -----------------------------------------------
def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "disttrain-watchdog"]


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("env", "watches"), [
    pytest.param({"RANK": "0", "WORLD_SIZE": "2"}, True, id="rank0-plain-torchrun"),
    pytest.param({"RANK": "1", "WORLD_SIZE": "2"}, True, id="rank1-watches-rank0"),
    pytest.param({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}, False,
                 id="other-ranks"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "1"}, False, id="one-rank"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2", "DISTTRAIN_WATCHDOG": "launcher"}, False,
                 id="under-disttrain-run"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2", "DISTTRAIN_WATCHDOG": "off"}, False,
                 id="turned-off"),
    pytest.param({"RANK": "x", "WORLD_SIZE": "2"}, False, id="bad-env-left-to-runtime"),
])
def test_ranks_0_and_1_watch_and_only_without_the_launcher(monkeypatch, env, watches):
    from disttrain.worker import _rank0_watchdog

    monkeypatch.delenv("DISTTRAIN_WATCHDOG", raising=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_unused_port()),
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)
    assert not _watchdog_threads()
    with _rank0_watchdog(timeout_s=TIMEOUT_S):
        assert bool(_watchdog_threads()) is watches
    assert not _watchdog_threads(), "the watchdog thread must stop with training"


def test_disttrain_run_marks_its_workers_as_watched(monkeypatch):
    from disttrain.launch.launchers import _watchdog

    monkeypatch.delenv("DISTTRAIN_WATCHDOG", raising=False)
    spec = JobSpec.from_dict({}, {"master_port": _unused_port(), "timeout_s": TIMEOUT_S})
    with _watchdog(spec, 2):
        assert os.environ.get("DISTTRAIN_WATCHDOG") == "launcher"
    assert "DISTTRAIN_WATCHDOG" not in os.environ
