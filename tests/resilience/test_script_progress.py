"""A script's progress besides optimizer steps (issue 25 items 2, 3, 6), without processes:
the watchdog's rule for a rank waiting in a collective, the probes around torch.distributed,
the once-per-step forward hook, the main-thread probe, and the script's live files."""

from __future__ import annotations

import json
import socket
import threading
import time
import types

import pytest

from disttrain.resilience.heartbeat import Heartbeat
from disttrain.resilience.watchdog import Watchdog

pytestmark = pytest.mark.timeout(60)
HOST = socket.gethostname()


def rec(rank, pid, seq, phase="forward", step=0, coll=0, in_coll="", alive=0):
    """A heartbeat record; `alive` moves while the rank's publisher runs (not frozen)."""
    return {"rank": rank, "pid": pid, "host": HOST, "step": step, "phase": phase, "seq": seq,
            "alive": alive, "coll": coll, "in_coll": in_coll}


def test_a_rank_waiting_at_a_barrier_for_a_working_rank_is_not_stalled(sleeper):
    """Rank 0 evaluates (progress) for 3x the timeout while rank 1 waits at a barrier: no
    stall. Then rank 0 stops: it is named (not rank 1), within the timeout."""
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    a, b = sleeper(), sleeper()
    for t in range(31):   # rank 0's seq moves every second; rank 1 waits in its barrier
        wd.observe({0: rec(0, a, seq=t, coll=1, alive=t),
                    1: rec(1, b, 5, "barrier", coll=2, in_coll="barrier", alive=t)}, now=t)
        assert wd.judge(now=t) is None, t
    for t in range(31, 42):   # rank 0 stops outside any collective
        wd.observe({0: rec(0, a, seq=30, coll=1, alive=t),
                    1: rec(1, b, 5, "barrier", coll=2, in_coll="barrier", alive=t)}, now=t)
    stall = wd.judge(now=41)
    assert stall is not None and stall.rank == 0 and not stall.tied
    assert "waiting for it: rank 1 (step 0, barrier)" in stall.message


def test_a_rank_that_just_entered_the_barrier_releases_the_waiting_one(sleeper):
    """Rank 0 ends its evaluation and enters the barrier rank 1 has waited in for longer
    than the timeout: a poll between that entry and the barrier's release names nobody
    (a busy clean-clone suite had named rank 1). Both then stuck there: named after the
    timeout, the one behind in collectives first."""
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=2, kill=False)
    a, b = sleeper(), sleeper()
    for t in range(7):   # rank 0 evaluates for 3x the timeout
        wd.observe({0: rec(0, a, seq=t, coll=1, alive=t),
                    1: rec(1, b, 5, "barrier", coll=2, in_coll="barrier", alive=t)}, now=t)
        assert wd.judge(now=t) is None, t
    wd.observe({0: rec(0, a, seq=7, phase="barrier", coll=2, in_coll="barrier", alive=7),
                1: rec(1, b, 5, "barrier", coll=2, in_coll="barrier", alive=7)}, now=7)
    assert wd.judge(now=7) is None
    for t in range(8, 10):   # the barrier never releases (a mismatched collective)
        wd.observe({0: rec(0, a, seq=7, phase="barrier", coll=2, in_coll="barrier", alive=t),
                    1: rec(1, b, 5, "barrier", coll=2, in_coll="barrier", alive=t)}, now=t)
    stall = wd.judge(now=9)
    assert stall is not None and {stall.rank, *(r for r, _ in stall.tied)} == {0, 1}


def test_the_rank_that_entered_fewer_collectives_is_named(sleeper):
    """All stopped, at the same step and phase: the one behind in collectives is blamed."""
    wd = Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, kill=False)
    a, b = sleeper(), sleeper()
    for t in range(12):
        wd.observe({0: rec(0, a, 7, "all_reduce", coll=3, in_coll="all_reduce", alive=t),
                    1: rec(1, b, 7, "all_reduce", coll=2, alive=t)}, now=t)
    stall = wd.judge(now=11)
    assert stall is not None and stall.rank == 1 and not stall.tied


def test_probes_start_the_watch_at_the_group_and_mark_collectives():
    from disttrain.resilience.script_probes import DistProbes

    hb: list[Heartbeat] = []
    calls, seen = [], []

    def all_gather(*a):   # what the rank looks like while it waits inside
        seen.append((hb[0].in_coll, hb[0].phase, hb[0].coll))

    def all_gather_object(*a):   # as torch's: built on all_gather, looked up at call time
        dist.all_gather(*a)

    dist = types.SimpleNamespace(is_available=lambda: True, all_gather=all_gather,
                                 init_process_group=lambda *a, **k: calls.append("init"),
                                 all_gather_object=all_gather_object)
    probes = DistProbes(lambda: hb[0] if hb else None, lambda: hb or hb.append(Heartbeat(0)))
    probes.install(dist)
    dist.init_process_group("gloo")
    assert calls == ["init"] and hb, "the watch starts when the group exists"
    dist.all_gather_object([1])
    assert seen == [("all_gather_object", "all_gather_object", 1)], "marked once, nested"
    assert (hb[0].in_coll, hb[0].phase, hb[0].coll) == ("", "setup", 1)
    probes.remove()
    assert dist.all_gather is all_gather


def test_the_forward_hook_fires_once_per_arming():
    import torch

    from disttrain.resilience.script_probes import FirstForward

    fired = []
    first = FirstForward(lambda: fired.append(1))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    first.arm()
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert fired == [1], "the model's own call only; submodules keep the fast path"
    first.arm()
    model(torch.ones(1, 2))
    assert fired == [1, 1]
    first.remove()


def test_the_main_thread_probe_tells_work_from_a_wait():
    from disttrain.resilience.script_heartbeat import _MainThreadMoves

    probe = _MainThreadMoves()
    answers: list[bool] = []

    def sample_while(main_does) -> None:
        t = threading.Thread(target=lambda: (time.sleep(0.2), probe(), time.sleep(0.3),
                                             answers.append(probe())))
        t.start()
        main_does(0.6)
        t.join()

    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(i * i for i in range(1000))

    sample_while(time.sleep)   # asleep: the same frame, no CPU
    sample_while(busy)         # a tight Python loop: CPU time
    assert answers == [False, True]


def test_script_live_files_and_summary(tmp_path):
    """A script rank's live file in the Trainer's format, its rows, and the summary the
    launcher writes from them: the straggler verdict names the rank that waits for data."""
    from disttrain.monitor.live import read_live
    from disttrain.monitor.script_live import ScriptLive, finish_script_run

    (tmp_path / "job.yaml").write_text("name: s\n")
    lives = []
    for rank, data in ((0, 0.001), (1, 0.05)):   # rank 1 waits 50 ms per step for data
        sums = {"step": 10 * (data + 0.011), "data": 10 * data, "compute": 0.01,
                "comm_wait": 10 * (0.05 - data), "optimizer": 0.0, "timed": 10}
        live = ScriptLive(tmp_path, rank, 2, lambda s=sums: (11, dict(s), 0.5))
        live.dir.mkdir(parents=True, exist_ok=True)
        live.write(done=True)
        lives.append(live)
    run = read_live(tmp_path)
    assert [r["step"] for r in run.ranks] == [11, 11] and run.done
    assert run.ranks[1]["data_ms"] == pytest.approx(50.0) and run.ranks[0]["loss"] == 0.5
    assert run.straggler is not None and run.straggler["rank"] == 1, run.straggler
    finish_script_run(tmp_path, exit_code=0, wall_s=3.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["straggler"]["cause"] == "data" and summary["steps"] == 11
    assert (tmp_path / "metrics.jsonl").read_text().count('"split": "train"') == 2
    # the Trainer took over inside the script: the script's writer stops, silently
    gone = ScriptLive(tmp_path, 0, 2, lambda: None)
    gone.write()
    assert not gone.enabled
