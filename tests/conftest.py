"""Shared fixtures: a fresh working dir per test, no leaked env vars or process groups."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]

# Property tests: `make test` runs the same inputs every time ("ci": a fixed seed, so a
# submission never fails on an input no earlier run tried; inputs that once found a bug
# are kept as @example). `make fuzz` (`--hypothesis-profile=fuzz`) draws new inputs on
# every run, ten times as many, to look for the next one.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("fuzz", max_examples=1000, derandomize=False, database=None,
                          deadline=None, print_blob=True)
settings.load_profile("ci")
# set by torch itself on first use of dynamo/inductor, not by the code under test
IGNORED_ENV = {"PYTEST_CURRENT_TEST", "OMP_NUM_THREADS", "DISTTRAIN_T0", "TORCHINDUCTOR_CACHE_DIR"}
DISTTRAIN = [sys.executable, "-m", "disttrain.cli.main"]


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


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 240, env: dict | None = None):
    """Run `disttrain ARGS` as a user would, in a subprocess; returns CompletedProcess."""
    import subprocess

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("DISTTRAIN_T0", None)
    return subprocess.run([*DISTTRAIN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


# The default digits job on 2 local ranks, checkpoints every 10 steps: 2 epochs = 46 optimizer
# steps, checkpoints at 10, 20, 23 (epoch end), 30, 40, 46 (the newest two kept). The files that
# prove exact resume after a fault compare with ONE undisturbed run of it (`digits_reference`),
# always of this same topology (1 host x 2 processes, the same threads): CPUs round other
# topologies differently (issue 21).
DIGITS_JOB = ("run", "--nproc-per-node", "2", "--checkpoint-every-steps", "10", "--master-port", "0")
REFERENCE_JOB = (*DIGITS_JOB, "--epochs", "2")
REFERENCE_STEPS = 46


@pytest.fixture(scope="session")
def digits_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of REFERENCE_JOB that nothing disturbed, made once per session.
    Read it (summary.json's params_sha256, its checkpoints); copy it before changing anything."""
    import json

    cwd = tmp_path_factory.mktemp("digits-reference")
    res = run_cli(*REFERENCE_JOB, "--run-dir", "ref", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((cwd / "ref" / "summary.json").read_text())
    assert summary["steps"] == REFERENCE_STEPS and summary["params_in_sync"] is True
    return cwd / "ref"


PART_STEPS = 30


@pytest.fixture(scope="session")
def digits_part(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of REFERENCE_JOB cut at step PART_STEPS (mid-epoch; checkpoints 23 and 30
    kept), made once per session for the tests that resume it after doing something to it.
    Never change it: take a `copy_run` of it."""
    import json

    cwd = tmp_path_factory.mktemp("digits-part")
    res = run_cli(*REFERENCE_JOB, "--max-steps", str(PART_STEPS), "--run-dir", "part", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((cwd / "part" / "summary.json").read_text())["steps"] == PART_STEPS
    return cwd / "part"


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
