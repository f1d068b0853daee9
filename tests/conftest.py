"""Shared fixtures: a fresh working dir per test, no leaked env vars or process groups."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]


# A C++ static destructor that aborts at exit (SIGABRT), registered by a script's first
# lines: what torch 2.13's gloo threads can do to a finished rank in the interpreter's
# teardown, injected every time (docs/resilience.md, "How a process ends")
ABORT_AT_EXIT = ("import ctypes\n_libc = ctypes.CDLL(None)\n"
                 "_libc.__cxa_atexit(_libc.abort, None, None)\n")


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip unless the optional packages are installed (the `make test` install has them),
    found without importing them: every pytest-xdist worker collects every file, and a
    module-level `pytest.importorskip("peft")` cost each worker ~3.3 s of CPU at collection
    (transformers ~0.6 s) for tests that one worker runs. The tests import them inside."""
    import importlib.util

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} "
                              "(pip install 'disttrain[hf,peft]')")

# Property tests: `make test` runs the same inputs every time ("ci": a fixed seed, so a
# submission never fails on an input no earlier run tried; inputs that once found a bug
# are kept as @example). `make fuzz` (`--hypothesis-profile=fuzz`) draws new inputs on
# every run, ten times as many, to look for the next one.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("fuzz", max_examples=1000, derandomize=False, database=None,
                          deadline=None, print_blob=True)
settings.load_profile("ci")
# No loss.png at the end of every run (envvars.NO_LOSS_PNG: ~1 s of a core on rank 0 each,
# some 140 runs); the tests of the plot itself turn it back on (`WITH_LOSS_PNG`).
os.environ["DISTTRAIN_NO_LOSS_PNG"] = "1"
WITH_LOSS_PNG = {"DISTTRAIN_NO_LOSS_PNG": ""}
# Every job blocks for its all-reduce (envvars.COMM_WAIT): `auto` polls when its probe finds a
# core free, and under pytest-xdist the next test's job then shares that core with a spinning
# rank (20 of 105 jobs of one suite run chose to poll). Polling has its own job in
# tests/launch/test_launchers.py (`shas`), whose parameters equal the blocking launchers'.
os.environ["DISTTRAIN_COMM_WAIT"] = "block"
# OpenMP threads sleep when they run out of work instead of spinning for it (libgomp spins
# first by default). The suite keeps its 2 cores oversubscribed by design (one more worker
# than cores, multi-rank jobs), and every 1-rank job and every worker's own torch runs 2
# intra-op threads: a spinning one holds a core another test's job is waiting for. Threads,
# results and the code under test are unchanged (a 1-rank chargpt job beside two busy
# processes: the same parameters, 3.0 instead of 3.6-4.0 s of CPU). Set before torch is
# first imported, which reads it once; every job the suite starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# set by torch itself on first use of dynamo/inductor, not by the code under test
IGNORED_ENV = {"PYTEST_CURRENT_TEST", "OMP_NUM_THREADS", "DISTTRAIN_T0", "TORCHINDUCTOR_CACHE_DIR"}
DISTTRAIN = [sys.executable, "-m", "disttrain.cli.main"]


# `make test` runs the suite on pytest-xdist workers (one more than the cores), a file at a
# time (`--dist loadfile --no-loadscope-reorder`): these files take the longest (the measured
# order, longest first), so they start first and the workers end together instead of one
# waiting on another's last long file. A file missing here only runs later; nothing else depends on it.
LONGEST_FIRST = (
    "tests/distributed/test_parallel_trainer.py",   # makes the session's one-process run
    "tests/resilience/test_hosts.py",
    "tests/distributed/test_composed_parallel.py",  # reads it (tests/distributed/conftest.py)
    "tests/distributed/test_pp_interleaved.py",
    "tests/k8s/test_gang_local.py",
    "tests/train/test_task_trainer.py",
    "tests/cli/test_run_cli.py",
    "tests/cli/test_run_script_watch.py",
    "tests/resilience/test_resilience.py",
    "tests/cli/test_run_task.py",
    "tests/recipes/test_causal_lm_dist.py",
    "tests/launch/test_launchers.py",
    "tests/train/test_checkpoint_storage.py",
    "tests/examples/test_chargpt_run.py",
    "tests/plan/test_accuracy.py",
    "tests/resilience/test_preemption.py",
    "tests/resilience/test_worker_watchdog.py",
    "tests/plan/test_lora_plan.py",
    "tests/k8s/test_install.py",
    "tests/cli/test_run_script.py",
    "tests/distributed/test_gpt2_parallel.py",
    "tests/k8s/test_output.py",
    "tests/k8s/test_local.py",
    "tests/diagnose/test_live.py",
    "tests/bench/test_bench.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the rest as collected."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = Path(str(item.path)).relative_to(ROOT).as_posix() if item.path else ""
        return rank.get(path, len(rank))

    items.sort(key=key)   # stable: the order within a file, and among the rest, is kept


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves env vars changed or a default process group open."""
    before = dict(os.environ)
    yield
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    changed = {k for k in set(before) | set(os.environ)
               if before.get(k) != os.environ.get(k) and k not in IGNORED_ENV}
    os.environ.clear()
    os.environ.update(before)
    assert not leaked_pg, "test left a process group open"
    assert not changed, f"test leaked environment variables: {sorted(changed)}"


def left_in(folder: Path) -> list[str]:
    """What a run left in `folder` as its temp folder: every name but torch inductor's
    cache, which torch keeps there on purpose (torchelastic_* folders and
    pytorch-errorfile-*.pickle are what disttrain must not leave)."""
    return [p.name for p in folder.iterdir() if not p.name.startswith("torchinductor")]


@pytest.fixture
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder as this process's and its children's temp folder (TMPDIR and
    tempfile's cached one), for tests that check what a run leaves there (`left_in`)."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def sigint_default() -> None:
    """preexec_fn for a child a test sends SIGINT (Ctrl-C): its default action, as a
    terminal's foreground job has it. An ignored signal stays ignored across exec, and a
    suite started in the background of a non-interactive shell (`make test &`) can hand its
    children an ignored SIGINT (one suite run here hung 120 s on it)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_env(env: dict | None = None) -> dict[str, str]:
    """The environment of a `disttrain` command a test starts: this process's, unbuffered,
    without this process's start time (envvars.T0: the command marks its own), plus `env`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("DISTTRAIN_T0", None)
    return full_env


# The environment the pytest worker started with (after the settings above): what the warm
# server of `run_cli` imports under (tests/warm_cli.py)
WARM_ENV = cli_env()
_warm: list = []   # this worker's tests/warm_cli.py server, started by its first command


def warm_server():
    """This worker's warm server (tests/warm_cli.py), started on first use."""
    from tests.warm_cli import WarmCli

    if not _warm:
        _warm.append(WarmCli.start(WARM_ENV))
    return _warm[0]


def _warm_cli(env: dict[str, str]):
    """The warm server, or None where a command with `env` must run fresh
    (tests/warm_cli.py `runs_warm`) or every command must (DISTTRAIN_TEST_FRESH=1,
    `make test-fresh`)."""
    from tests.warm_cli import runs_warm

    fresh = os.environ.get("DISTTRAIN_TEST_FRESH") or not runs_warm(env, WARM_ENV)
    return None if fresh else warm_server()


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 240, env: dict | None = None):
    """Run `disttrain ARGS` as a user would, in a process of its own; returns
    CompletedProcess. The process is forked from this worker's warm server
    (tests/warm_cli.py: the same command, without the interpreter's start and its ~3 s of
    imports) unless its environment differs in what is read at import, or
    DISTTRAIN_TEST_FRESH=1; then it is a new `python -m disttrain.cli.main`."""
    import subprocess

    full_env = cli_env(env)
    warm = _warm_cli(full_env)
    if warm is not None:
        return warm.run(list(args), cwd=cwd, env=full_env, timeout=timeout)
    return subprocess.run([*DISTTRAIN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def start_cli(*args: str, cwd: Path, log: Path, env: dict | None = None,
              start_new_session: bool = False):
    """Start `disttrain ARGS` in the background, its stdout and stderr into `log`, forked
    warm as `run_cli`'s (or fresh); returns a Popen or tests/warm_cli.py's WarmProcess
    (pid, poll, wait, kill, returncode)."""
    import subprocess

    full_env = cli_env(env)
    warm = _warm_cli(full_env)
    with open(log, "w") as out:
        if warm is not None:
            return warm.popen(list(args), cwd=cwd, env=full_env, stdout=out.fileno(),
                              stderr=out.fileno(), start_new_session=start_new_session)
        return subprocess.Popen([*DISTTRAIN, *args], cwd=cwd, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=start_new_session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop this worker's warm server (it would also end with the worker: its stdin closes)."""
    for warm in _warm:
        warm.stop()


# The default digits job on 2 local ranks, checkpoints every 10 steps: 2 epochs = 46 optimizer
# steps, checkpoints at 10, 20, 23 (epoch end), 30, 40, 46 (the newest two kept). The files that
# prove exact resume after a fault compare with ONE undisturbed run of it (`digits_reference`),
# always of this same topology (1 host x 2 processes, the same threads): CPUs round other
# topologies differently (issue 21).
DIGITS_JOB = ("run", "--nproc-per-node", "2", "--checkpoint-every-steps", "10", "--master-port", "0")
REFERENCE_JOB = (*DIGITS_JOB, "--epochs", "2")
REFERENCE_STEPS = 46


def _made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(cwd)`'s run dir, made once for the whole session: under pytest-xdist the
    workers share one (the first makes it under a file lock in their common temp folder,
    the others wait for it and read it) rather than each training the same job again."""
    from filelock import FileLock

    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent        # pytest-of-USER/pytest-N: shared by this run's workers
    cwd, done = base / f"shared-{name}", base / f"shared-{name}.done"
    with FileLock(str(base / f"shared-{name}.lock"), timeout=600):
        if not done.exists():
            cwd.mkdir(exist_ok=True)
            done.write_text(str(make(cwd)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def digits_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of REFERENCE_JOB that nothing disturbed, made once per session.
    Read it (summary.json's params_sha256, its checkpoints); copy it before changing anything."""
    import json

    def make(cwd: Path) -> Path:
        res = run_cli(*REFERENCE_JOB, "--run-dir", "ref", cwd=cwd)
        assert res.returncode == 0, res.stderr[-3000:]
        summary = json.loads((cwd / "ref" / "summary.json").read_text())
        assert summary["steps"] == REFERENCE_STEPS and summary["params_in_sync"] is True
        return cwd / "ref"

    return _made_once(tmp_path_factory, "digits-reference", make)


PART_STEPS = 30


@pytest.fixture(scope="session")
def digits_part(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of REFERENCE_JOB cut at step PART_STEPS (mid-epoch; checkpoints 23 and 30
    kept), made once per session for the tests that resume it after doing something to it.
    Never change it: take a `copy_run` of it."""
    import json

    def make(cwd: Path) -> Path:
        res = run_cli(*REFERENCE_JOB, "--max-steps", str(PART_STEPS), "--run-dir", "part", cwd=cwd)
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads((cwd / "part" / "summary.json").read_text())["steps"] == PART_STEPS
        return cwd / "part"

    return _made_once(tmp_path_factory, "digits-part", make)


# The default digits job on 2 emulated hosts of `disttrain k8s run-local`, one rank per host
# (gloo): 1 epoch = 23 optimizer steps, a checkpoint every 5, a 15 s collective timeout. The
# faulted jobs of tests/resilience/test_hosts.py compare with ONE undisturbed run of it (the
# same topology: a rank alone on its host has all the cores as threads, and CPUs round 1 and
# 2 threads differently, issue 21); tests/k8s/test_local.py reads it as run-local's
# end-to-end training run. Needs root and `ip netns` (the tests that use it skip otherwise).
TWO_HOST_TIMEOUT_S = 15
TWO_HOST_JOB = ("k8s", "run-local", "--kind", "job", "--nnodes", "2", "--nproc-per-node", "1",
                "--backend", "gloo", "--epochs", "1", "--checkpoint-every-steps", "5",
                "--timeout-s", str(TWO_HOST_TIMEOUT_S))
TWO_HOST_STEPS = 23


class TwoHostJob:
    """`disttrain k8s run-local` of TWO_HOST_JOB (plus `extra` flags), in the background."""

    def __init__(self, cwd: Path, *extra: str) -> None:
        import subprocess

        self.run_dir = cwd / "run"
        self.proc = subprocess.Popen(
            [*DISTTRAIN, *TWO_HOST_JOB, *extra, "--run-dir", str(self.run_dir), "--timeout", "240"],
            cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.tag = f"dt{self.proc.pid}"

    def wait_for_checkpoint(self, step: int) -> None:
        import time

        ckpt = self.run_dir / "checkpoints" / f"ckpt-{step:08d}.pt"
        deadline = time.monotonic() + 180
        while not ckpt.exists():
            assert self.proc.poll() is None, self.finish()[1][-3000:]
            assert time.monotonic() < deadline, f"no {ckpt.name} within 180 s"
            time.sleep(0.1)

    def finish(self, timeout: float = 200) -> tuple[str, str]:
        try:
            return self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()  # run-local removes its namespaces on SIGTERM
                self.proc.communicate(timeout=60)

    def summary(self) -> dict:
        import json

        return json.loads((self.run_dir / "summary.json").read_text())

    def leftovers(self) -> list[str]:
        import subprocess

        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=False).stdout.split()
        return [n for n in names if n.startswith(f"{self.tag}-")]


@pytest.fixture(scope="session")
def two_host_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of TWO_HOST_JOB that nothing disturbed, made once per session; run-local's
    stdout is beside it (`run-local.out`). Read it, never change it."""

    def make(cwd: Path) -> Path:
        job = TwoHostJob(cwd)
        out, err = job.finish(timeout=300)
        assert job.proc.returncode == 0, (out + err)[-4000:]
        (cwd / "run-local.out").write_text(out)
        summary = job.summary()
        assert summary["steps"] == TWO_HOST_STEPS and summary["params_in_sync"] is True
        assert job.leftovers() == [], "namespaces left"
        return job.run_dir

    return _made_once(tmp_path_factory, "two-host-reference", make)


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of run dir `src` at `dst` as the run left it: hard links stay hard links
    (checkpoints/last.pt is one to the newest checkpoint), none shared with `src`."""
    import subprocess

    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


@pytest.fixture
def no_stray_workers(tmp_path):
    """Kill whatever a failed test left running in its folder (a SIGSTOPped worker
    would otherwise stay forever)."""
    yield
    for proc in psutil.process_iter():
        try:
            if Path(proc.cwd()).is_relative_to(tmp_path):
                proc.kill()
        except (psutil.Error, OSError, ValueError):
            continue
