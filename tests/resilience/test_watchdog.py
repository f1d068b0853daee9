"""The watchdog's judgement (pure, no processes) and the heartbeat's fault hook parsing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from disttrain.resilience import watchdog
from disttrain.resilience.faults import Fault
from disttrain.resilience.heartbeat import Heartbeat, interval_for
from disttrain.resilience.watchdog import STALL_EXIT_CODE, Watchdog, stall_line

pytestmark = pytest.mark.timeout(60)
HOST = socket.gethostname()


def rec(rank: int, pid: int, step: int, phase: str, seq: int, alive: int, host: str = HOST):
    return {"rank": rank, "pid": pid, "host": host, "step": step, "phase": phase,
            "seq": seq, "alive": alive}


def test_fresh_ranks_are_not_stalled(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    a, b = sleeper(), sleeper()
    wd.observe({0: rec(0, a, 5, "forward", 1, 1), 1: rec(1, b, 5, "forward", 1, 1)}, now=0)
    wd.observe({0: rec(0, a, 6, "forward", 2, 2), 1: rec(1, b, 6, "forward", 2, 2)}, now=9)
    assert wd.judge(now=18) is None  # both moved at t=9


def test_frozen_rank_is_blamed_not_the_one_waiting_for_it(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    a, b = sleeper(), sleeper()
    wd.observe({0: rec(0, a, 17, "backward", 5, 1), 1: rec(1, b, 17, "backward", 5, 1)}, now=0)
    # rank 0's publisher keeps running (alive moves), rank 1's stopped with it (SIGSTOP)
    for t in range(1, 12):
        wd.observe({0: rec(0, a, 17, "backward", 5, 1 + t), 1: rec(1, b, 17, "backward", 5, 1)},
                   now=t)
    stall = wd.judge(now=11)
    assert stall is not None and stall.rank == 1 and stall.frozen
    assert stall.message.startswith(f"rank 1 (pid {b}, host {HOST}) made no progress for 11 s; "
                                    f"last seen: step 17, phase backward")
    assert "not running" in stall.message and "waiting for it: rank 0" in stall.message


def test_rank1_backup_acts_only_on_a_frozen_rank0(sleeper):
    """The backup watch (ranks=(0,), frozen_only) leaves an alive rank 0 to its own
    watchdog, ignores the other ranks, and names rank 0 once its process stopped."""
    wd = Watchdog("127.0.0.1", 1, world_size=1, timeout_s=10, kill=False, ranks=(0,),
                  frozen_only=True)
    a, b = sleeper(), sleeper()
    for t in range(0, 13):  # rank 0 waits alive (publisher runs); rank 1 is frozen
        wd.observe({0: rec(0, a, 17, "backward", 5, t), 1: rec(1, b, 17, "backward", 5, 1)},
                   now=t)
    assert wd.judge(now=12) is None, "an alive rank 0 watches for itself; rank 1 is not ours"
    for t in range(13, 26):  # now rank 0's publisher stops too: the whole process stopped
        wd.observe({0: rec(0, a, 17, "backward", 5, 12)}, now=t)
    stall = wd.judge(now=25)
    assert stall is not None and stall.rank == 0 and stall.frozen
    line = stall_line(stall, ends_job=True, exiting_rank=1)
    assert line.endswith("ending the job (rank 1 exits with code 1)")


def test_rank_furthest_behind_is_blamed_when_all_are_alive(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=3, timeout_s=10, kill=False)
    pids = [sleeper() for _ in range(3)]
    state = {0: (18, "backward"), 1: (17, "between steps"), 2: (18, "backward")}
    for t in range(0, 12):
        wd.observe({r: rec(r, pids[r], *state[r], seq=3, alive=t) for r in range(3)}, now=t)
    stall = wd.judge(now=11)
    assert stall is not None and stall.rank == 1 and not stall.frozen
    assert "alive but stuck" in stall.message
    assert [r for r, _, _ in stall.waiting] == [0, 2]


def test_alive_ranks_at_the_same_place_are_all_named(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    a, b = sleeper(), sleeper()
    for t in range(0, 12):
        wd.observe({0: rec(0, a, 17, "backward", 4, t), 1: rec(1, b, 17, "backward", 4, t)}, now=t)
    stall = wd.judge(now=11)
    assert stall is not None and stall.message.startswith("ranks 0, 1 (pids")
    assert set(stall.pids) == {a, b}


def test_exited_ranks_and_remote_ranks(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    wd.observe({0: rec(0, dead.pid, 3, "forward", 1, 1)}, now=0)
    assert wd.judge(now=100) is None, "an exited rank is torchrun's to report, not a stall"
    wd.observe({1: rec(1, 12345, 3, "forward", 1, 1, host="other-node")}, now=0)
    stall = wd.judge(now=100)
    assert stall is not None and stall.rank == 1 and not stall.local


def test_act_kills_the_local_stalled_rank_and_starts_afresh(sleeper):
    seen = []
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, on_stall=seen.append)
    a, b = sleeper(), sleeper()
    wd.observe({0: rec(0, a, 1, "forward", 1, 1), 1: rec(1, b, 1, "forward", 1, 1)}, now=0)
    wd.observe({0: rec(0, a, 2, "forward", 2, 2), 1: rec(1, b, 1, "forward", 1, 1)}, now=11)
    stall = wd.judge(now=11)
    assert stall is not None and stall.rank == 1
    wd.act(stall)
    assert seen == [stall] and wd.stalls == [stall]
    deadline = time.time() + 10
    while time.time() < deadline and wd._running(rec(1, b, 0, "", 0, 0)):
        time.sleep(0.05)
    assert not wd._running(rec(1, b, 0, "", 0, 0)), "the stalled rank must be killed"
    assert wd.judge(now=12) is None  # rank 0 is judged anew, from now on


def test_timeouts():
    """How often heartbeats go out; the collective timeout is tested with the runtime."""
    assert interval_for(1) == 0.1 and interval_for(10) == 0.5 and interval_for(600) == 2.0


@pytest.mark.parametrize(("text", "expected"), [
    ("kill:rank=1:step=17", Fault("kill", 1, 17)),
    ("stop:rank=0:step=3:phase=backward", Fault("stop", 0, 3, "backward")),
    ("hang:rank=2:step=0:restart=1", Fault("hang", 2, 0, None, 1)),
])
def test_fault_parse(text, expected):
    assert Fault.parse(text) == expected


def test_a_chain_of_faults_gives_each_rank_and_round_its_own(monkeypatch):
    chain = "kill:rank=1:step=1,kill:rank=1:step=19:restart=1, stop:rank=0:step=3:restart=1"
    monkeypatch.setenv("DISTTRAIN_FAULT", chain)
    assert Fault.from_env(1, 0) == Fault("kill", 1, 1)
    assert Fault.from_env(1, 1) == Fault("kill", 1, 19, None, 1)
    assert Fault.from_env(0, 1) == Fault("stop", 0, 3, None, 1)
    assert Fault.from_env(0, 0) is None and Fault.from_env(1, 2) is None
    monkeypatch.setenv("DISTTRAIN_FAULT", chain + ",kill:rank=1")
    with pytest.raises(ValueError, match="expected ACTION:rank=R:step=S"):
        Fault.from_env(1, 0)   # one malformed fault refuses the whole list


@pytest.mark.parametrize("text", ["", "kill", "kill:rank=1", "boom:rank=1:step=2",
                                  "kill:rank=x:step=2", "kill:rank=1:step=2:color=red"])
def test_fault_parse_rejects_with_usage(text):
    with pytest.raises(ValueError, match="expected ACTION:rank=R:step=S"):
        Fault.parse(text)


def test_fault_fires_once_at_its_step_and_phase_only_in_its_round():
    fault = Fault("raise", 0, 2, "backward")
    hb = Heartbeat(0, restart=0, fault=fault)
    hb.beat(2)              # forward of step 2: not yet
    hb.mark("optimizer")
    hb.beat(1)
    hb.mark("backward")     # step 1: not yet
    hb.beat(2)
    with pytest.raises(RuntimeError, match="fault injection"):
        hb.mark("backward")
    hb.mark("backward")     # fired once
    assert Heartbeat(0, restart=1, fault=fault)._fault is None, "not armed after a restart"
    assert Heartbeat(1, restart=0, fault=fault)._fault is None, "not armed on other ranks"


def test_heartbeat_counts_progress_without_publishing():
    hb = Heartbeat(0)
    for i in range(1000):
        hb.beat(i)
    assert hb.seq == 1000 and hb.step == 999 and hb.phase == "forward"
    record = hb.record()
    assert record["pid"] == os.getpid() and record["alive"] == 0


def test_finished_ranks_are_never_stalled(sleeper):
    wd = Watchdog("127.0.0.1", 1, world_size=1, timeout_s=10, kill=False)
    a = sleeper()
    wd.observe({0: rec(0, a, 46, "done", 9, 9)}, now=0)
    assert wd.judge(now=1000) is None


def test_in_job_watchdog_reports_kills_then_exits_never_killing_itself(sleeper, monkeypatch):
    """Rank 0's watchdog (plain torchrun): report, kill the local stalled rank, then end
    its own process; a stall of rank 0 itself is ended by the exit, not a self-SIGKILL."""
    exits, seen = [], []
    monkeypatch.setattr(watchdog, "exit_now", exits.append)
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, on_stall=seen.append,
                  exit_code=STALL_EXIT_CODE)
    b = sleeper()
    me = os.getpid()
    for t in range(0, 12):  # both alive; rank 0 stuck outside a collective, same place
        wd.observe({0: rec(0, me, 4, "backward", 3, t), 1: rec(1, b, 4, "backward", 3, t)}, now=t)
    stall = wd.judge(now=11)
    assert stall is not None and set(stall.pids) == {me, b}
    wd.act(stall)  # would SIGKILL this test process if it did not skip its own pid
    assert seen == [stall] and exits == [STALL_EXIT_CODE]
    deadline = time.time() + 10
    while time.time() < deadline and wd._running(rec(1, b, 0, "", 0, 0)):
        time.sleep(0.05)
    assert not wd._running(rec(1, b, 0, "", 0, 0)), "the other stalled rank must be killed"


def test_stall_line_is_what_the_doctor_reads():
    from disttrain.diagnose.logs import diagnose

    stall = watchdog.Stall(1, 4242, HOST, 17, "backward", 30.2, frozen=True)
    assert stall_line(stall) == f"error: {stall.message}; stopping it"
    line = stall_line(stall, ends_job=True)
    assert line.startswith(f"error: rank 1 (pid 4242, host {HOST}) made no progress for 30 s; "
                           f"last seen: step 17, phase backward;")
    assert line.endswith(f"; stopping it; ending the job (rank 0 exits with code {STALL_EXIT_CODE})")
    d = diagnose(line)
    assert (d.cause, d.rank) == ("collective_timeout", 1)
    remote = watchdog.Stall(1, 4242, "other", 17, "backward", 30.2, frozen=True, local=False)
    assert "stopping it" not in stall_line(remote)
