"""CPU contention for a benchmark: N busy processes on the same cores, for its duration.

    with contention(2, limit_s=3600):       # two processes spinning on this process's CPUs
        run_overhead(...)                   # the Trainer and the plain loop, both contended

A pod with a CPU limit on a shared node, or a laptop running a build, is the normal case, and
the comm hook's waiting strategy (distributed/comm_wait.py) must not lose to a plain loop
there (issue 21). The busy processes inherit this process's affinity, so they compete for
the cores the job runs on. They are bounded three ways: stopped (SIGTERM, then SIGKILL) when
the block ends, however it ends; each ends itself after `limit_s`; and each ends when its
parent is gone (its parent pid changes), so a killed benchmark leaves none behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# A pure-Python loop: no I/O, no sleeps; it checks its deadline and its parent every ~10 ms.
BUSY = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def contention(n: int, limit_s: float = 3600.0) -> Iterator[list[int]]:
    """Run `n` busy processes while the block runs; yields their pids (none for n = 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid()), f"{limit_s:g}"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(max(0, n))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
