"""Fixtures shared by the watchdog tests: real local processes standing for ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture
def sleeper():
    """A real local process to stand for a rank (the watchdog checks pids are alive);
    call it for each pid needed; all are killed after the test."""
    procs: list[subprocess.Popen] = []

    def make() -> int:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(p)
        return p.pid

    yield make
    for p in procs:
        p.kill()
        p.wait(timeout=10)
