"""Leaving `runtime.setup()` really ends the process group: gloo's threads are gone before
interpreter teardown, also when an optimizer (which imports torch._dynamo) was built in
between. A group left running into teardown once aborted a rank of a finished run under
plain torchrun ("terminate called without an active exception")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disttrain.launch import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import os, torch
from disttrain import runtime
with runtime.setup("gloo", 60, threads=1) as rt:
    model = torch.nn.Linear(4, 4)
    torch.optim.Adam(model.parameters())      # imports torch._dynamo, after the group exists
    rt.all_gather_object(rt.rank)
task = f"/proc/{os.getpid()}/task"
names = sorted(open(f"{task}/{t}/comm").read().strip() for t in os.listdir(task))
with open(f"threads{rt.rank}.txt", "w") as f:  # one file per rank: stdout lines interleave
    f.write(" ".join(names))
"""


def test_no_gloo_threads_outlive_the_runtime(tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "probe.py"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        names = (tmp_path / f"threads{rank}.txt").read_text().split()
        assert "python" in names, names
        assert not [n for n in names if "gloo" in n], f"rank {rank} threads: {names}"
