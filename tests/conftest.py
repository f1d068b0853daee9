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
