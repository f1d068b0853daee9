"""Fixtures for the multi-process tests."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest


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
