"""Which process is which: live workers' titles and RUN_DIR/ranks.json (docs/resilience.md).

Rank 1 SIGSTOPs itself at step 6 (the test-only fault hook), which holds both workers
alive long enough to read their /proc entries; the watchdog then kills it and torchrun
restarts the round, which must rewrite ranks.json with the new pids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from disttrain.errors import EXIT_STOPPED
from disttrain.resilience import proctitle
from tests.conftest import DISTTRAIN, cli_env

pytestmark = [pytest.mark.usefixtures("no_stray_workers")]


def test_titles_fit_the_kernels_name() -> None:
    assert proctitle.rank_title(3, 8, "mnist") == "disttrain rank 3/8 job mnist"
    assert len(proctitle.short_title(127, 256).encode()) <= proctitle.COMM_LIMIT


def _wait_for(pred, timeout_s: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        assert proc.poll() is None, f"the job ended ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s")


def _ranks(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_workers_are_titled_and_ranks_json_follows_restarts(tmp_path: Path) -> None:
    env = cli_env({"DISTTRAIN_FAULT": "stop:rank=1:step=6"})
    proc = subprocess.Popen(
        [*DISTTRAIN, "run", "--name", "titled", "--nproc-per-node", "2", "--epochs", "1",
         "--max-steps", "10", "--checkpoint-every-steps", "5", "--max-restarts", "1",
         "--timeout-s", "8", "--master-port", "0", "--run-dir", "run"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks_json = tmp_path / "run" / "ranks.json"
    try:
        first = _wait_for(lambda: _ranks(ranks_json), 180, "ranks.json", proc)
        assert first["job"] == "titled" and first["world_size"] == 2 and first["restart"] == 0
        by_rank = {r["rank"]: r for r in first["ranks"]}
        assert sorted(by_rank) == [0, 1]
        # rank 1 stops itself at step 6: both are alive (rank 0 waits in a collective)
        _wait_for(lambda: psutil.Process(by_rank[1]["pid"]).status() == psutil.STATUS_STOPPED,
                  120, "rank 1 stopped", proc)
        for rank, rec in by_rank.items():
            pid = rec["pid"]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
            assert cmdline.decode() == f"disttrain rank {rank}/2 job titled"
            assert Path(f"/proc/{pid}/comm").read_text().strip() == f"dt rank {rank}/2"
            args = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True,
                                  text=True, check=True).stdout.strip()
            assert args == f"disttrain rank {rank}/2 job titled"
            assert rec["host"] and rec["local_rank"] == rank and rec["node_rank"] == 0
            assert rec["device"] == "cpu"
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    second = json.loads(ranks_json.read_text())
    assert second["restart"] == 1, "the restarted round must rewrite ranks.json"
    new = {r["rank"]: r["pid"] for r in second["ranks"]}
    assert sorted(new) == [0, 1] and set(new.values()).isdisjoint(
        r["pid"] for r in first["ranks"])


@pytest.mark.timeout(300)
def test_a_one_rank_jobs_worker_is_titled_and_leads_its_own_session(tmp_path: Path) -> None:
    """World size 1 looks like a plain process to RANK/WORLD_SIZE, but its worker is the
    agent's: titled, and its own session where the kernel schedules by session, as a
    torchrun worker (docs/performance.md, "One rank, too"); SIGTERM still stops it."""
    proc = subprocess.Popen(
        [*DISTTRAIN, "run", "--name", "solo", "--nproc-per-node", "1", "--epochs", "1000",
         "--max-steps", "1000000", "--checkpoint-every-epochs", "0", "--master-port", "0",
         "--run-dir", "run"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ranks = _wait_for(lambda: _ranks(tmp_path / "run" / "ranks.json"), 180, "ranks.json", proc)
        (rec,) = ranks["ranks"]
        pid = rec["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        assert cmdline.decode() == "disttrain rank 0/1 job solo"
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
        by_session = autogroup.exists() and autogroup.read_text().strip() == "1"
        assert (os.getsid(pid) == pid) == by_session, "own session exactly when autogroup is on"
        assert os.getsid(proc.pid) == os.getsid(0), "the command stays in the caller's session"
        # training, so the stop is the graceful one (at a step, with a checkpoint)
        _wait_for(lambda: _ranks(tmp_path / "run" / "live" / "rank-0.json"), 120, "a step", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    assert "stopped by SIGTERM at step" in out


def test_a_single_process_is_titled_only_when_the_agent_started_it(tmp_path, monkeypatch) -> None:
    """A user's own `python train.py` (or a notebook) running a one-process Trainer keeps
    its title; torchrun's agent's one worker gets the rank title (resilience/ranks.py)."""
    from types import SimpleNamespace

    from disttrain import envvars
    from disttrain.distributed.env import read_env
    from disttrain.resilience import ranks

    titled: list[tuple] = []
    monkeypatch.setattr(ranks, "set_rank_title", lambda *a: titled.append(a))
    rt = SimpleNamespace(rank=0, world_size=1, local_rank=0, device="cpu", is_rank0=True,
                         all_gather_object=lambda obj: [obj])
    monkeypatch.delenv(envvars.RUN_ID, raising=False)
    rt.env = read_env({})                                     # a user's own process
    ranks.identify(tmp_path / "a", "mine", rt)
    assert titled == [] and (tmp_path / "a" / "ranks.json").exists()
    monkeypatch.setenv(envvars.RUN_ID, "mine-1234")
    rt.env = read_env({"RANK": "0", "WORLD_SIZE": "1", envvars.RUN_ID: "mine-1234"})
    ranks.identify(tmp_path / "b", "mine", rt)
    assert titled == [(0, 1, "mine")]
