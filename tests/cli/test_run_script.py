"""`disttrain run SCRIPT` for a user's own, unmodified script (issue 16 items 2, 4, 5, 6):
its own run dir per attempt, flags that do not apply refused, a heartbeat from its
optimizer steps, and a script that spawns its own workers refused. The scripts under
`scripts/` are reduced from real training scripts' structure."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain.launch.own_workers import own_workers
from disttrain.spec.fields import is_dns1123_label
from tests.conftest import ABORT_AT_EXIT, run_cli

SCRIPTS = Path(__file__).parent / "scripts"
ENTRY = [sys.executable, "-m", "disttrain.resilience.script_heartbeat", "--timeout-s=30"]


# -- 5. the heartbeat entry is `python script.py` ----------------------------------------
SHOW = """import sys, os
print(__name__, os.path.basename(sys.argv[0]), sys.argv[1:], os.path.basename(sys.path[0]))
"""


@pytest.mark.parametrize("body", [
    SHOW,
    SHOW + "sys.exit(3)\n",
    SHOW + "sys.exit('bye')\n",
    SHOW + "def f():\n    raise ValueError('boom')\nf()\n",
])
def test_entry_runs_a_script_as_python_does(tmp_path, body):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "s.py"
    script.write_text(body)
    args = ["sub/s.py", "--batch_size", "3", "--", "x"]
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    entry = subprocess.run([*ENTRY, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert (entry.returncode, entry.stdout, entry.stderr) == (
        plain.returncode, plain.stdout, plain.stderr)
    assert "__main__ s.py ['--batch_size', '3', '--', 'x'] sub" in entry.stdout


ENDS = ABORT_AT_EXIT + """import atexit, sys, threading, time
atexit.register(print, "atexit ran")
log = open("out.txt", "w")                   # never closed: the exit writes it
log.write("kept")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended"))).start()
print("script ended")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_entry_ends_as_python_does_without_the_teardown_that_aborts(tmp_path, status):
    """A finished rank's exit could abort in torch's teardown ("terminate called without an
    active exception", SIGABRT: a script run of this suite) and fail its job. Here a C++
    static destructor that aborts stands in for it: plain python ends with SIGABRT, the
    entry with the script's status, having done what a normal exit does first (the thread
    joined, the atexit handler run, the unclosed file written)."""
    script = tmp_path / "s.py"
    script.write_text(ENDS)
    plain = subprocess.run([sys.executable, str(script), str(status)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == -6, plain   # the injected fault: the normal exit aborts
    (tmp_path / "out.txt").unlink()
    entry = subprocess.run([*ENTRY, str(script), str(status)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert entry.returncode == status, entry.stderr
    assert entry.stdout.splitlines() == ["script ended", "thread ended", "atexit ran"]
    assert entry.stdout == plain.stdout and entry.stderr == plain.stderr == ""
    assert (tmp_path / "out.txt").read_text() == "kept"


def test_entry_leaves_a_thread_that_never_ends_after_its_timeout(tmp_path):
    """plain python would wait forever for a non-daemon thread; the entry waits --timeout-s,
    says which thread it leaves, and ends with the script's status."""
    script = tmp_path / "s.py"
    script.write_text("import threading, time\n"
                      "threading.Thread(target=time.sleep, args=(600,), name='poller').start()\n")
    entry = subprocess.run([*ENTRY[:-1], "--timeout-s=1", str(script)], capture_output=True,
                           text=True, timeout=60)
    assert entry.returncode == 0
    assert "warning: thread(s) poller still running 1 s after the script ended" in entry.stderr


def test_entry_writes_whole_lines_even_under_python_u(tmp_path):
    """`disttrain run` starts scripts with `python -u`, which writes `print("a", 1)` in four
    pieces; torch's tee reads a growing file by `readline` and printed half lines with another
    rank's line between them (a CI failure). The entry writes a line at a time, still at
    once: line buffering on, write-through off, for stdout and stderr."""
    script = tmp_path / "s.py"
    script.write_text("import sys\nfor s in (sys.stdout, sys.stderr):\n"
                      "    print(s.line_buffering, s.write_through, flush=True)\n")
    plain = subprocess.run([sys.executable, "-u", str(script)], capture_output=True, text=True,
                           timeout=60)
    entry = subprocess.run([sys.executable, "-u", *ENTRY[1:], str(script)], capture_output=True,
                           text=True, timeout=60)
    assert plain.stdout.split() == ["False", "True", "False", "True"]  # what -u gives
    assert entry.stdout.split() == ["True", "False", "True", "False"], entry.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unmodified_script_that_stalls_is_named_within_the_timeout(tmp_path, no_stray_workers):
    res = run_cli("run", str(SCRIPTS / "stall_after_3_steps.py"), "--nproc-per-node", "2",
                  "--timeout-s", "5", "--", "50", cwd=tmp_path, timeout=100)
    ended = time.time()
    assert res.returncode != 0
    stalled = float(re.search(r"stalling at ([\d.]+)", res.stdout).group(1))
    assert ended - stalled < 5 + 30, ended - stalled  # the job ends within timeout + 30 s
    assert "error: rank 1 (pid " in res.stderr, res.stderr[-3000:]
    assert "made no progress for 5 s; last seen: step 3" in res.stderr
    assert "failed rank(s): 1)" in res.stderr


# A script that never steps an optimizer (rank 0 evaluating while the others wait at a
# barrier): tests/cli/test_run_script_watch.py


# -- 2. each script its own run dir, every attempt kept ----------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_script_and_attempt_gets_its_own_run_dir(tmp_path):
    (tmp_path / "a.py").write_text("print('a ran')\n")
    (tmp_path / "My_Train.py").write_text("print('b')\n")
    for _ in range(2):
        res = run_cli("run", "a.py", "--nproc-per-node", "1", cwd=tmp_path, timeout=90)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "--resume" not in res.stdout + res.stderr
    base = tmp_path / "runs" / "a"
    assert sorted(p.name for p in base.iterdir()) == ["latest", "run-1", "run-2"]
    assert (base / "latest").resolve() == (base / "run-2").resolve()
    for attempt in ("run-1", "run-2"):  # the first attempt's logs survive the second
        logs = list((base / attempt / "logs").rglob("*.log"))
        assert any("a ran" in p.read_text() for p in logs), attempt
        assert "name: a\n" in (base / attempt / "job.yaml").read_text()
    # the [train] flags a script does use (--threads, --run-dir) are accepted
    dry = run_cli("run", "My_Train.py", "--threads", "1", "--dry-run", cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "name: my-train\n" in dry.stdout and is_dns1123_label("my-train")
    assert "run_dir: runs/My_Train/run-1" in dry.stdout
    assert "-m disttrain.resilience.script_heartbeat --timeout-s=300 My_Train.py" in dry.stdout


# -- 4. flags that do not apply are refused ------------------------------------------------
def test_builtin_job_flags_are_refused_for_a_script(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    res = run_cli("run", "train.py", "--epochs", "3", "--lr", "0.1", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith("error: --epochs, --lr: built-in job flags")
    assert "after --: train.py -- --epochs" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()
    # the script's own flag without `--`: not "did you mean --batch-size?"
    res = run_cli("run", "train.py", "--batch_size", "8", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert "put the script's own arguments after --" in res.stderr
    assert "Did you mean" not in res.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("verb", [["run"], ["k8s", "render"]])
def test_help_groups_a_scripts_flags_apart_from_the_builtin_jobs(verb):
    out = run_cli(*verb, "--help", timeout=60).stdout
    launch, builtin = out.index("Launch options (SCRIPT"), out.index("Built-in job options")
    assert launch < out.index("--nproc-per-node") < out.index("--run-dir") < builtin
    assert builtin < out.index("--epochs") and builtin < out.index("--batch-size")
    if verb[0] == "k8s":
        assert out.index("Cluster options (SCRIPT") < out.index("--image ") < builtin


# -- 6. scripts that start their own workers ------------------------------------------------
def test_a_script_that_spawns_its_own_workers_is_refused_with_two_per_node(tmp_path):
    script = str(SCRIPTS / "spawns_own_workers.py")
    res = run_cli("run", script, "--nproc-per-node", "2", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert "starts its own worker processes (mp.spawn at line 17)" in res.stderr
    assert "--nproc-per-node 1 (or leave the flag out)" in res.stderr
    assert not (tmp_path / "runs").exists()
    one = run_cli("run", script, "--nproc-per-node", "1", "--dry-run", cwd=tmp_path, timeout=60)
    assert one.returncode == 0, one.stderr
    auto = run_cli("run", script, "--dry-run", cwd=tmp_path, timeout=60)   # auto: one copy
    assert auto.returncode == 0 and "--nproc_per_node=1 " in auto.stdout, auto.stderr
    assert "running it as one process" in auto.stderr


@pytest.mark.parametrize(("source", "line"), [
    ("import torch.multiprocessing as mp\nmp.spawn(f, nprocs=2)\n", 2),
    ("from torch.multiprocessing import spawn as sp\nsp(f, nprocs=2)\n", 2),
    ("import torch.multiprocessing\ntorch.multiprocessing.start_processes(f)\n", 2),
    ("import multiprocessing as mp\np = mp.Process(target=f, args=(0,))\n", 2),
    ("from torch.multiprocessing import Process\nProcess(target=f)\n", 2),
    # torchrun or its own spawn, chosen by the launcher's variables: fine under torchrun
    ("import os\nimport torch.multiprocessing as mp\nif 'LOCAL_RANK' in os.environ:\n"
     "    f(0)\nelse:\n    mp.spawn(f, nprocs=2)\n", None),
    ("import multiprocessing as mp\nq = mp.Queue()\n", None),  # no worker started
    ("def spawn(f): pass\nspawn(print)\n", None),  # not torch's
])
def test_own_workers_finds_spawns_through_aliases(tmp_path, source, line):
    path = tmp_path / "s.py"
    path.write_text(source)
    found = own_workers(path)
    assert [w.line for w in found] == ([line] if line else [])


def test_optimizer_steps_beat_the_heartbeat_unless_disttrain_runs_its_own():
    import torch
    import torch.optim.optimizer as optimizer_module

    from disttrain.resilience import heartbeat
    from disttrain.resilience.script_heartbeat import ScriptHeartbeat

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    hooks = ScriptHeartbeat(rank=0, timeout_s=30, store=None)  # None: in memory only
    hooks.install(optimizer_module)
    try:
        assert heartbeat.current() is None
        step()  # the first step starts it
        hb = heartbeat.current()
        assert hb is not None and (hb.step, hb.phase) == (1, "data")
        opt.zero_grad()
        out = model(torch.ones(2, 3))
        assert hb.phase == "forward"  # the global forward hook
        out.sum().backward()
        assert hb.phase == "backward"  # the hook on the optimizer's last parameter
        opt.step()
        assert (hb.step, hb.phase) == (2, "data")
    finally:
        hooks.stop()
    assert heartbeat.current() is None
    step()  # the hooks are gone with stop()
    assert hb.step == 2

    own = heartbeat.start(rank=0, timeout_s=30)  # the Trainer's, started by the script
    hooks = ScriptHeartbeat(rank=0, timeout_s=30, store=None)
    hooks.install(optimizer_module)
    try:
        step()
        step()
        assert heartbeat.current() is own and own.step == 0  # left to the Trainer
    finally:
        hooks.stop()
        heartbeat.stop()
