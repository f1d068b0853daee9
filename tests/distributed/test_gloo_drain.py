"""gloo's worker threads are idle before a rank's interpreter may end (distributed/gloo_drain.py):
read from /proc, an untimed futex wait is idle, a timed one (the GIL) or a running thread is
not; in a live gloo group, `Runtime.shutdown` leaves them idle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disttrain.distributed.gloo_drain import FUTEX, RUNLOOP, runloops_idle

pytestmark = pytest.mark.skipif(FUTEX is None, reason="futex's number is known for x86_64 and aarch64")


def _task(root: Path, tid: int, comm: str, syscall: str) -> None:
    (root / str(tid)).mkdir()
    (root / str(tid) / "comm").write_text(comm + "\n")
    (root / str(tid) / "syscall").write_text(syscall + "\n")


def test_only_untimed_futex_waits_of_gloo_threads_are_idle(tmp_path):
    idle = f"{FUTEX} 0x55d0c0de 0x189 0x0 0x0 0x0 0xffffffff 0x7ffd0 0x7f00"
    _task(tmp_path, 1, "python", "running")                       # not gloo's: ignored
    _task(tmp_path, 2, RUNLOOP, idle)
    _task(tmp_path, 3, RUNLOOP, idle)
    assert runloops_idle(tmp_path) is True
    _task(tmp_path, 4, RUNLOOP, f"{FUTEX} 0x7f11 0x189 0x0 0x7ffd1230 0x0 0xffffffff 0x1 0x2")
    assert runloops_idle(tmp_path) is False                        # waiting for the GIL
    (tmp_path / "4" / "syscall").write_text("running\n")
    assert runloops_idle(tmp_path) is False                        # freeing a work
    (tmp_path / "4" / "syscall").write_text("0 0x3 0x7ffd 0x400 0x0 0x0 0x0 0x1 0x2\n")
    assert runloops_idle(tmp_path) is False                        # another syscall
    assert runloops_idle(tmp_path / "missing") is None             # /proc cannot tell


def test_a_gloo_rank_leaves_shutdown_with_its_workers_idle(tmp_path):
    code = textwrap.dedent("""
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        import torch, torch.distributed as dist
        from disttrain.distributed import runtime
        from disttrain.distributed.gloo_drain import RUNLOOP, runloops_idle
        rt = runtime.setup("gloo", 30)
        out = [None]
        dist.all_gather_object(out, {"x": torch.ones(3)})
        dist.barrier()
        rt.shutdown()
        names = [open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")]
        print(names.count(RUNLOOP), runloops_idle(), flush=True)
        os._exit(0)
    """)
    from disttrain.launch.ports import free_port

    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PORT": str(free_port())})
    assert ended.returncode == 0, ended.stderr[-2000:]
    threads, idle = ended.stdout.split()
    assert int(threads) >= 1 and idle == "True", ended.stdout  # the group's threads, kept, idle

