"""tests/warm_cli.py, the warm server `run_cli` forks commands from: a command forked from
it ends as the same command run fresh (exit status, stdout, stderr, what it writes where),
reads the stdin it is given, is killed at its timeout as subprocess.run kills, and runs
fresh when its environment differs in what imports read."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import DISTTRAIN, WARM_ENV, cli_env, warm_server
from tests.warm_cli import FORK_SAFE_ENV, PRELOAD, WarmCli, runs_warm

pytestmark = pytest.mark.timeout(300)

JOB = ("run", "--max-steps", "2", "--master-port", "0", "--run-dir", "job")
REFUSED = ("run", "--nproc-per-node", "0")
# a line `disttrain doctor logs` names the cause of (tests/diagnose have the rules)
LOG_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"


@pytest.fixture(scope="module")
def warm() -> WarmCli:
    """This worker's server, as `run_cli` uses it (started here under DISTTRAIN_TEST_FRESH=1)."""
    return warm_server()


def _fresh(args: tuple[str, ...], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*DISTTRAIN, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=240, **kw)


def test_a_job_forked_warm_ends_as_the_same_job_run_fresh(warm, tmp_path):
    (tmp_path / "warm").mkdir()
    (tmp_path / "fresh").mkdir()
    got = warm.run(list(JOB), cwd=tmp_path / "warm", env=cli_env(), timeout=240)
    want = _fresh(JOB, tmp_path / "fresh")
    assert got.returncode == want.returncode == 0, got.stderr[-3000:]
    shas = [json.loads((tmp_path / side / "job" / "summary.json").read_text())["params_sha256"]
            for side in ("warm", "fresh")]
    assert shas[0] == shas[1]
    assert shas[0][:16] in got.stdout            # its stdout came back through the pipe


def test_the_job_forks_its_warm_fork_server_from_itself(warm, tmp_path):
    """As outside the suite: `disttrain run` forks its fork server from itself after its
    own torch import (disttrain.launch.forkserver), not a new interpreter; the server and
    the ranks carry their titles (disttrain.resilience.proctitle)."""
    env = {**cli_env(), "DISTTRAIN_FAULT": "slow-data:rank=0:ms=200"}
    done: list[subprocess.CompletedProcess] = []
    job = threading.Thread(target=lambda: done.append(warm.run(
        [*JOB[:2], "30", *JOB[3:]], cwd=tmp_path, env=env, timeout=240)))
    job.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while job.is_alive() and time.monotonic() < deadline and len(seen) < 3:
        for command in psutil.Process(warm.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                for child in command.children(recursive=True):
                    title = " ".join(child.cmdline()).strip()
                    if title == f"disttrain forkserver of {command.pid}" or \
                            title.startswith("disttrain rank "):
                        seen.add(title.split(" job ")[0].replace(str(command.pid), "PID"))
        time.sleep(0.2)
    job.join(240)
    assert done and done[0].returncode == 0, done and done[0].stderr[-3000:]
    assert seen == {"disttrain forkserver of PID", "disttrain rank 0/2", "disttrain rank 1/2"}


def test_refused_input_exits_2_with_the_same_message(warm, tmp_path):
    got = warm.run(list(REFUSED), cwd=tmp_path, env=cli_env(), timeout=60)
    want = _fresh(REFUSED, tmp_path)
    assert got.returncode == want.returncode == 2
    assert got.stderr == want.stderr and "nproc_per_node" in got.stderr
    assert got.stdout == want.stdout
    assert os.listdir(tmp_path) == []


def test_the_command_reads_the_stdin_it_is_given(warm, tmp_path):
    log = tmp_path / "captured.log"
    log.write_text(LOG_LINE)
    with open(log) as stdin:
        got = warm.run(["doctor", "logs", "-", "--json"], cwd=tmp_path, env=cli_env(),
                       timeout=60, stdin=stdin.fileno())
    with open(log) as stdin:
        want = _fresh(("doctor", "logs", "-", "--json"), tmp_path, stdin=stdin)
    assert got.returncode == want.returncode == 1
    assert json.loads(got.stdout)["cause"] == json.loads(want.stdout)["cause"] != "unknown"


def test_a_command_past_its_timeout_is_killed(warm, tmp_path):
    read, write = os.pipe()   # stdin that never ends: `doctor logs -` waits on it
    try:
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            warm.run(["doctor", "logs", "-"], cwd=tmp_path, env=cli_env(), timeout=3, stdin=read)
        assert time.monotonic() - started < 60
    finally:
        os.close(read)
        os.close(write)
    waiting = [p for p in psutil.Process(warm.proc.pid).children()
               if p.status() != psutil.STATUS_ZOMBIE]
    assert waiting == [], "the timed-out command still runs"


def test_an_environment_imports_read_runs_fresh():
    assert runs_warm({**WARM_ENV, "DISTTRAIN_FAULT": "kill:rank=1:step=3"}, WARM_ENV)
    assert not runs_warm({**WARM_ENV, "TMPDIR": "/tmp/x"}, WARM_ENV)   # torch._dynamo reads it
    assert not runs_warm({**WARM_ENV, "OMP_NUM_THREADS": "7"}, WARM_ENV)
    assert not runs_warm({**WARM_ENV, "PYTHONPATH": "/x"}, WARM_ENV)
    assert not runs_warm({k: v for k, v in WARM_ENV.items() if k != "PATH"}, WARM_ENV)


def test_importing_the_preload_reads_none_of_the_variables_a_command_may_change():
    """What FORK_SAFE_ENV lets a warm command set differently must not be read by an import
    (the server imported with its own values)."""
    probe = f"""
import json, os
read = set()
class Recording(dict):
    def __getitem__(self, key):
        read.add(key); return super().__getitem__(key)
    def get(self, key, default=None):
        read.add(key); return super().get(key, default)
    def __contains__(self, key):
        read.add(key); return super().__contains__(key)
os.environ = Recording(os.environ)
import importlib
for module in {list(PRELOAD)!r}:
    importlib.import_module(module)
print(json.dumps(sorted(read)))
"""
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=240, env=cli_env(), cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    read = json.loads(res.stdout.splitlines()[-1])
    assert read, "the probe saw no read at all: it no longer records them"
    assert [k for k in read if k.startswith(FORK_SAFE_ENV)] == []


def test_a_background_command_is_polled_waited_for_and_killed(warm, tmp_path):
    read, write = os.pipe()
    try:
        proc = warm.popen(["doctor", "logs", "-"], cwd=tmp_path, env=cli_env(), stdin=read,
                          start_new_session=True)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)
        assert os.getsid(proc.pid) == proc.pid          # start_new_session, as Popen's
        proc.kill()
        assert proc.wait(60) == -9 and proc.poll() == -9
    finally:
        os.close(read)
        os.close(write)
