"""The warm fork server as `disttrain run` starts it: a fork of the launcher right after its
torch import (`disttrain.launch.forkserver`, share_torch), that workers start from warm.

Each case runs in a fresh interpreter (a script in a subprocess, JSON back): forking the
pytest-xdist worker, whose earlier tests leave threads behind, is exactly what
`_may_fork_server` refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCENARIO = textwrap.dedent("""
    import json, multiprocessing, os, sys
    import multiprocessing.forkserver as forkserver
    {before}
    from disttrain.launch.forkserver import prewarm_workers, stop_prewarmed

    kept_r, kept_w = os.pipe()          # a pipe this process has open: the server must not
    started = prewarm_workers(share_torch=True, share_imports=("xml.dom.minidom",))
    pid = forkserver._forkserver._forkserver_pid
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(1) as pool:         # a worker forked from the server: warm, and it runs
        warm = pool.apply(eval, ("{{m: m in __import__('sys').modules "
                                 "for m in ('torch', 'torch._dynamo', 'xml.dom.minidom')}}",))
    # read after the server forked a worker: it closes what it was not given before that
    server_fds = {{os.readlink(f"/proc/{{pid}}/fd/{{fd}}") for fd in os.listdir(f"/proc/{{pid}}/fd")}}
    ours = os.readlink(f"/proc/self/fd/{{kept_w}}")
    with open(f"/proc/{{pid}}/cmdline", "rb") as f:   # it titles itself before serving
        cmdline = f.read().replace(b"\\0", b" ").decode().strip()
    stop_prewarmed()
    print(json.dumps({{"started": started,
                      "exec": "from multiprocessing.forkserver import main" in cmdline,
                      "title": cmdline, "launcher": os.getpid(),
                      "holds_our_pipe": ours in server_fds, "warm": warm,
                      "server_gone": not os.path.exists(f"/proc/{{pid}}")}}))
""")


def _scenario(before: str = "") -> dict:
    res = subprocess.run([sys.executable, "-c", SCENARIO.format(before=before)],
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_the_server_is_a_fork_of_the_launcher_and_its_workers_start_warm() -> None:
    got = _scenario()
    assert got["started"] is True
    assert got["exec"] is False, "the server was a new interpreter, not a fork"
    # titled as what it is, not with the launcher's command line that the fork copied
    assert got["title"] == f"disttrain forkserver of {got['launcher']}"
    # what the launcher imported for itself before the fork is there too (share_imports)
    assert got["warm"] == {"torch": True, "torch._dynamo": True, "xml.dom.minidom": True}
    assert got["holds_our_pipe"] is False, "the forked server kept an fd it was not given"
    assert got["server_gone"] is True


@pytest.mark.parametrize("before", [
    # torch has (or may have) run here already: a fork could inherit its OpenMP team
    "import torch; torch.ones(1000).sum()",
    # another thread runs: it could hold a lock that the fork would copy held
    "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
], ids=["torch-imported", "a-thread-runs"])
def test_a_launcher_that_may_not_fork_gets_a_new_interpreter(before: str) -> None:
    got = _scenario(before=before)
    assert got["started"] is True
    assert got["exec"] is True
    # a new interpreter imports only the preload: the launcher's own imports stay its own
    assert got["warm"] == {"torch": True, "torch._dynamo": True, "xml.dom.minidom": False}
    assert got["holds_our_pipe"] is False and got["server_gone"] is True
