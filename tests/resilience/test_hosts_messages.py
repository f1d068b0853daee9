"""The words a lost or partitioned host is named with, without processes (docs/resilience.md).

The end-to-end cases (real namespaces, real faults) are in test_hosts.py; these pin the
pure parts they rely on, and run everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.diagnose.logs import diagnose
from disttrain.k8s.local import LocalPod, lost_host_line
from disttrain.resilience.ranks import RANKS_JSON, ranks_on, read_ranks
from disttrain.resilience.watchdog import Stall, stall_line


def _stall(local: bool, frozen: bool = True) -> Stall:
    return Stall(rank=1, pid=4242, host="trainer-1", step=9, phase="backward", stale_s=15.2,
                 frozen=frozen, waiting=((0, 10, "backward"),), local=local)


def test_a_silent_remote_rank_names_its_host_as_unreachable() -> None:
    line = stall_line(_stall(local=False), ends_job=True)
    assert "nothing arrives from host trainer-1: it is unreachable" in line
    assert "not running" not in line
    # the same frozen rank on this host is a stopped process, as before
    assert "the process is not running" in stall_line(_stall(local=True))
    # alive but stuck says so wherever it runs
    assert "alive but stuck" in stall_line(_stall(local=False, frozen=False))


def test_the_doctor_names_the_unreachable_host_not_the_pod_that_printed_it() -> None:
    log = ("[trainer-0] " + stall_line(_stall(local=False), ends_job=True) + "\n"
           "[trainer-1] [rank1]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] "
           "Timed out waiting 17000ms for send operation to complete\n")
    found = diagnose(log)
    assert found.cause == "collective_timeout"
    assert (found.rank, found.host) == (1, "trainer-1")
    assert "host trainer-1 unreachable" in found.title


def test_a_lost_pod_is_named_with_the_ranks_ranks_json_gives_it(tmp_path: Path) -> None:
    (tmp_path / RANKS_JSON).write_text(json.dumps({"ranks": [
        {"rank": r, "host": f"trainer-{r // 2}", "pid": 100 + r} for r in range(4)]}))
    ranks = read_ranks(tmp_path)
    assert ranks_on("trainer-1", ranks) == [2, 3]
    pod = LocalPod("trainer-1", "trainer-1", ("trainer-1",), "198.18.0.2", (), {}, None, (), {})
    assert lost_host_line(pod, tmp_path).startswith("host trainer-1 lost with ranks 2, 3: pod "
                                                    "trainer-1 was killed by SIGKILL")
    assert read_ranks(tmp_path / "missing") == {}
    assert lost_host_line(pod, tmp_path / "missing").startswith("host trainer-1 lost: pod")
