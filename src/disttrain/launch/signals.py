"""A launcher's signal handling: what torch's agent changes is put back, and a launcher
without an agent (`--launcher spawn`) forwards SIGTERM / SIGINT to its workers itself
(docs/resilience.md, "Graceful stop")."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def signals_restored() -> Iterator[None]:
    """Put back this process's SIGTERM / SIGINT / SIGHUP / SIGQUIT handlers after the
    launch: torch's agent installs its own (they raise SignalException) and leaves them."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def forwarding_signals(pids: list[int]) -> Iterator[list[int]]:
    """While the block runs, SIGTERM / SIGINT to this process go to the `pids` (the
    `--launcher spawn` workers, which have no elastic agent to forward them); the signals
    received are yielded. Main thread only (elsewhere: nothing is installed)."""
    got: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    with signals_restored():
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, forward)
        yield got
