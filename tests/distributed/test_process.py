"""`process.own_session`: a rank leads its own session (its own autogroup), as a torchrun
worker does, only when the kernel schedules by session (issue 21)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# own_session runs in a fresh interpreter, never in pytest itself (it would leave the
# terminal's session) nor in a fork of it: a fork of an xdist worker that earlier tests
# left with threads can hang on a lock one of them held (the clean-clone CI of fabf7e8:
# all three tests' children silent for 60 s).
_CHILD = """
import json, os, sys
from pathlib import Path
from disttrain.distributed.process import own_session
flag = Path(sys.argv[1])
before = os.getsid(0)
made = [own_session(flag) for _ in range(int(sys.argv[2]))]
print(json.dumps({"made": made, "before": before, "after": os.getsid(0), "pid": os.getpid()}))
"""


def _in_child(flag: Path, calls: int = 1) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(flag), str(calls)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_with_autogroup_on_the_rank_leads_a_new_session(tmp_path):
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    got = _in_child(flag)
    assert got["made"] == [True] and got["after"] == got["pid"] != got["before"]


def test_with_autogroup_off_or_unknown_nothing_changes(tmp_path):
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("0\n")
    for path in (flag, tmp_path / "missing"):
        got = _in_child(path)
        assert got["made"] == [False] and got["after"] == got["before"]


def test_a_session_leader_stays_as_it_is(tmp_path):
    """torchrun's own workers already lead a session: setsid fails, nothing changes."""
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    got = _in_child(flag, calls=2)
    assert got["made"] == [True, False] and got["after"] == got["pid"]
