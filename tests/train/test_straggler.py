"""The straggler verdict (`train/straggler.py`), the live window rule, the step timer's
arithmetic, the slowdown faults (syntax, and where they sleep), the HAMi identity and the
telemetry owner's records and files (`train/telemetry.py`): one process, no process group."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.resilience.faults import Fault
from disttrain.train.phases import PHASES, STEP_KEYS, StepTimes
from disttrain.train.step_timing import StepTimer
from disttrain.train.straggler import StragglerWatch, find_straggler


def _rank(rank: int, data: float = 0.2, compute: float = 10.0, comm: float = 1.0,
          opt: float = 2.0, other: float = 0.3, **extra: object) -> dict[str, object]:
    step = data + compute + comm + opt + other
    return {"rank": rank, "host": f"job-{rank}", "device": "cuda:0", "samples_per_s": 100.0,
            "step_ms": step, "data_ms": data, "compute_ms": compute, "comm_wait_ms": comm,
            "optimizer_ms": opt, "other_ms": other, **extra}


def test_slow_compute_rank_is_named_with_its_factor_and_the_others_wait():
    ranks = [_rank(0, comm=19.0), _rank(1, compute=28.0, comm=1.0), _rank(2, comm=18.0),
             _rank(3, comm=18.5)]
    v = find_straggler(ranks)
    assert v is not None
    assert (v["rank"], v["host"], v["device"], v["cause"]) == (1, "job-1", "cuda:0", "compute")
    assert v["factor"] == 2.8
    assert v["message"].startswith("rank 1 (host job-1, cuda:0) is the straggler: it computes 2.8x longer")
    assert "wait for it in the all-reduce" in v["message"]


def test_a_rank_slow_in_wall_time_but_not_in_cpu_time_is_named_for_cpu_share():
    # rank 1's compute took 2.5x as long for about the same CPU time: it waited for a core
    ranks = [_rank(0, comm=16.0, compute_cpu_ms=9.5), _rank(1, compute=25.0, compute_cpu_ms=10.5)]
    v = find_straggler(ranks)
    assert v is not None and (v["rank"], v["cause"], v["factor"]) == (1, "cpu share", 2.5)
    assert "for about the same CPU time (10.5 ms against 9.5 ms): it waits for a core" in v["message"]
    # the same wall times with the CPU time to match: more work, named for compute
    ranks[1]["compute_cpu_ms"] = 24.0
    assert find_straggler(ranks)["cause"] == "compute"  # type: ignore[index]
    # not measured (CUDA, a script's live files: 0 or absent): compute, as before
    for value in (0.0, None):
        ranks[0]["compute_cpu_ms"] = value
        assert find_straggler(ranks)["cause"] == "compute"  # type: ignore[index]
    # a busy machine: every rank gets ~40 % of a core (compute 2.6x its CPU time), rank 1
    # has 4.4x the work; most of its extra time is waiting, but no more than the others'
    # per ms of CPU: more work, named for compute (a 3-worker test suite on 2 cores)
    busy = [_rank(0, comm=30.0, compute=10.0, compute_cpu_ms=3.8),
            _rank(1, compute=43.0, compute_cpu_ms=16.8)]
    assert find_straggler(busy)["cause"] == "compute"  # type: ignore[index]
    # a busy machine cuts a long compute into more slices than a short one: rank 1 (3x the
    # work, 15 ms of CPU against 5) waited 4 ms per CPU-ms, the others 2; still more work
    sliced = [_rank(0, comm=50.0, compute=10.0, compute_cpu_ms=5.0),
              _rank(1, compute=60.0, compute_cpu_ms=15.0)]
    assert find_straggler(sliced)["cause"] == "compute"  # type: ignore[index]
    # under tp / pp a rank's compute holds its waits for its partners: compute, never cpu share
    tp = [_rank(r, compute=25.0 if r == 1 else 10.0, comm=16.0 if r != 1 else 1.0,
                compute_cpu_ms=10.0, mesh={"tp": [r, 2]}) for r in (0, 1)]
    assert find_straggler(tp)["cause"] == "compute"  # type: ignore[index]


def test_two_ranks_factor_is_against_the_other_rank_not_the_mean():
    v = find_straggler([_rank(0, comm=20.0), _rank(1, compute=30.0)])
    assert v is not None and v["rank"] == 1 and v["factor"] == 3.0


def test_slow_data_rank_is_named_for_data_and_the_hami_limit_is_in_the_message():
    ranks = [_rank(0, comm=9.0), _rank(1, data=9.0, limit="HAMi CUDA_DEVICE_SM_LIMIT=30%"),
             _rank(2, comm=9.0)]
    v = find_straggler(ranks)
    assert v is not None and (v["rank"], v["cause"]) == (1, "data")
    assert "HAMi CUDA_DEVICE_SM_LIMIT=30%" in v["message"] and "data" in v["message"]


def test_a_rank_that_waits_longer_while_computing_as_fast_is_named_for_communication():
    ranks = [_rank(0, comm=1.0), _rank(1, comm=9.0), _rank(2, comm=1.2)]
    v = find_straggler(ranks)
    assert v is not None and (v["rank"], v["cause"]) == (1, "communication")


def test_the_fast_ranks_waiting_for_a_mild_straggler_are_not_named_for_communication():
    # rank 1 computes 1.4x (under the threshold): rank 0 waits for it, but is not the culprit
    assert find_straggler([_rank(0, compute=10.0, comm=5.0), _rank(1, compute=14.0, comm=1.0)]) is None


def test_uniform_ranks_small_differences_and_a_single_rank_name_nobody():
    assert find_straggler([_rank(r) for r in range(4)]) is None
    assert find_straggler([_rank(0)]) is None
    assert find_straggler([]) is None
    # 3x, but 0.2 ms of a 14 ms step: noise
    assert find_straggler([_rank(0, data=0.1), _rank(1, data=0.3)]) is None


_ms = st.floats(min_value=0.0, max_value=1000.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(base=st.lists(st.tuples(_ms, _ms, _ms), min_size=2, max_size=8),
       spread=st.lists(st.floats(min_value=1.0, max_value=1.5), min_size=24, max_size=24))
def test_never_names_a_rank_when_all_are_within_the_threshold(base, spread):
    # Every rank's data, compute and comm wait within 1.5x of every other rank's.
    d, c, w = base[0]
    ranks = [_rank(i, data=d * spread[3 * i % 24], compute=c * spread[(3 * i + 1) % 24],
                   comm=w * spread[(3 * i + 2) % 24]) for i in range(len(base))]
    assert find_straggler(ranks, threshold=1.5) is None


def test_live_verdict_needs_three_consecutive_windows_and_is_made_once():
    slow = [_rank(0, comm=20.0), _rank(1, compute=30.0)]
    calm = [_rank(0), _rank(1)]
    watch = StragglerWatch()
    assert watch.window(slow) is None          # one or two slow intervals: noise
    assert watch.window(slow) is None
    assert watch.window(calm) is None
    assert watch.window(slow) is None
    assert watch.window(slow) is None
    v = watch.window(slow)                     # the third in a row: the verdict
    assert v is not None and v["rank"] == 1
    assert watch.window(slow) is None          # said once
    assert watch.verdict == v


def test_step_timer_phases_add_up_to_the_step():
    timer = StepTimer()
    timer.start()
    for _ in timer.timed(range(3)):
        time.sleep(0.004)                      # the batch's copy to the device: data
        timer.compute_start()
        time.sleep(0.003)
        timer.bucket_ready()
        time.sleep(0.002)
        timer.compute_end()
        timer.optimizer_start()
        time.sleep(0.001)
        timer.optimizer_end()
    means = timer.interval().as_dict()
    parts = sum(means[k] for k in PHASES)
    assert means["step_ms"] == pytest.approx(parts, abs=0.01)
    assert means["data_ms"] >= 4.0 and means["compute_ms"] >= 3.0
    assert means["comm_wait_ms"] >= 2.0 and means["optimizer_ms"] >= 1.0
    assert timer.interval() == StepTimes()   # the next interval starts empty
    assert timer.run_means().compute_ms == means["compute_ms"]   # one interval: the run


def test_slowdown_faults_parse_and_failures_still_need_a_step():
    assert Fault.parse("slow-compute:rank=1:factor=3") == Fault("slow-compute", 1, 0, factor=3.0)
    f = Fault.parse("slow-data:rank=0:ms=20:step=5")
    assert (f.action, f.rank, f.step, f.ms, f.slowdown) == ("slow-data", 0, 5, 20.0, True)
    assert not Fault.parse("kill:rank=1:step=3").slowdown
    assert Fault.parse("cpu-share:rank=1") == Fault("cpu-share", 1, 0)
    assert Fault.parse("cpu-share:rank=1").slowdown
    for bad in ("slow-data:rank=0", "slow-compute:rank=1:ms=3", "slow-compute:rank=1:factor=0.5",
                "slow-compute:rank=1:factor=3:phase=forward", "kill:rank=1",
                "cpu-share:rank=1:step=4", "cpu-share:rank=1:factor=2", "cpu-share:step=1"):
        with pytest.raises(ValueError, match="expected ACTION"):
            Fault.parse(bad)


def test_live_files_never_stop_training_when_the_run_dir_cannot_be_written(tmp_path, capsys):
    from types import SimpleNamespace

    import torch

    from disttrain.train.telemetry import LiveStatus

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    rt = SimpleNamespace(rank=0, world_size=1, is_rank0=True, device=torch.device("cpu"))
    live = LiveStatus(rt, blocked)  # type: ignore[arg-type]
    live.write(0, 5, 1.0, 10.0, StepTimes(*(1.0,) * len(STEP_KEYS)))
    live.done()
    assert not live.enabled and blocked.read_text() == "not a folder"
    assert capsys.readouterr().err.count("live status files off") == 1
    ok = LiveStatus(rt, tmp_path / "run")  # type: ignore[arg-type]
    ok.write(0, 5, 1.0, 10.0, StepTimes(*(1.0,) * len(STEP_KEYS)))
    assert (tmp_path / "run" / "live" / "rank-0.json").exists()


def test_the_phase_list_is_one_list_for_every_writer_and_reader():
    from disttrain.monitor import report, top

    assert STEP_KEYS == ("step_ms", "data_ms", "compute_ms", "comm_wait_ms", "optimizer_ms", "other_ms",
                         "compute_cpu_ms")
    assert STEP_KEYS[1:6] == PHASES
    assert set(report.COLOURS) == set(report.SHORT) == set(top.COLOURS) == set(PHASES)
    assert StepTimes(1.0, 2.0).as_dict() == {"step_ms": 1.0, "data_ms": 2.0, "compute_ms": 0.0,
                                              "comm_wait_ms": 0.0, "optimizer_ms": 0.0, "other_ms": 0.0,
                                              "compute_cpu_ms": 0.0}


def _sleeps(monkeypatch) -> list[float]:
    """What the slowdowns waited: slow-data sleeps, slow-compute busy-waits."""
    from disttrain.resilience import faults

    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(faults, "busy_wait", slept.append)
    return slept


def test_no_fault_installs_no_slowdown_and_a_fault_for_another_rank_neither(monkeypatch):
    from disttrain import envvars
    from disttrain.resilience.faults import Slowdown

    monkeypatch.delenv(envvars.FAULT, raising=False)
    timer = StepTimer()
    assert Slowdown.install(timer, 0) is None and timer.delay_compute is None
    monkeypatch.setenv(envvars.FAULT, "slow-compute:rank=1:factor=3")
    assert Slowdown.install(timer, 0) is None and timer.delay_compute is None
    monkeypatch.setenv(envvars.FAULT, "kill:rank=0:step=3")   # the heartbeat's, not the timer's
    assert Slowdown.install(timer, 0) is None


def test_slow_compute_waits_factor_minus_one_times_the_compute_without_its_own_wait(monkeypatch):
    from disttrain import envvars
    from disttrain.resilience import faults
    from disttrain.resilience.faults import Slowdown

    slept: list[float] = []
    clock = [0.0]

    def busy_wait(seconds: float) -> None:   # a wait that takes its time on a fake clock
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(faults, "busy_wait", busy_wait)
    monkeypatch.setenv(envvars.FAULT, "slow-compute:rank=1:factor=3:step=1")
    timer = StepTimer()
    slow = Slowdown.install(timer, 1)
    assert slow is not None and timer.delay_compute == slow.delay_compute
    slow.clock = lambda: clock[0]
    slow.delay_compute(0.010)            # before step 1: nothing
    timer.steps = 1
    slow.delay_compute(0.010)            # 10 ms measured: busy-waits 20 ms
    slow.delay_compute(0.030)            # 30 ms measured, 20 of them its wait: again 20 ms
    assert slept == pytest.approx([0.020, 0.020])


def test_slow_data_delays_each_batch_from_its_step_on(monkeypatch):
    from disttrain import envvars
    from disttrain.resilience.faults import Slowdown

    slept = _sleeps(monkeypatch)
    monkeypatch.setenv(envvars.FAULT, "slow-data:rank=0:ms=30:step=2")
    timer = StepTimer()
    slow = Slowdown.install(timer, 0)
    assert slow is not None and timer.delay_compute is None
    got = []
    for item in slow.batches(range(4)):
        got.append(item)
        timer.steps += 1
    assert got == [0, 1, 2, 3] and slept == pytest.approx([0.030, 0.030])


def test_rank_identity_names_the_hami_limits_read_from_the_environment(monkeypatch):
    from types import SimpleNamespace

    import torch

    from disttrain import envvars
    from disttrain.train.telemetry import rank_identity

    rt = SimpleNamespace(rank=1, device=torch.device("cpu"))
    monkeypatch.delenv(envvars.CUDA_DEVICE_SM_LIMIT, raising=False)
    monkeypatch.delenv(envvars.CUDA_DEVICE_MEMORY_LIMIT, raising=False)
    assert "limit" not in rank_identity(rt)  # type: ignore[arg-type]
    monkeypatch.setenv(envvars.CUDA_DEVICE_SM_LIMIT, "30")
    monkeypatch.setenv(f"{envvars.CUDA_DEVICE_MEMORY_LIMIT}_0", "4g")
    assert rank_identity(rt)["limit"] == "HAMi CUDA_DEVICE_SM_LIMIT=30%, gpumem 4096 MiB"  # type: ignore[arg-type]
    limits = envvars.hami_limits({"CUDA_DEVICE_MEMORY_LIMIT": "512m", "CUDA_DEVICE_SM_LIMIT": "x"})
    assert (limits.sm_limit_percent, limits.default_memory_limit_mib) == (None, 512)


def test_telemetry_writes_named_records_as_rows_and_the_live_file(tmp_path):
    """One rank, no process group: the owner's records become metrics.jsonl rows with the
    phase columns, the live file follows each logging step, and finish() gives the
    summary's per-rank means."""
    import json
    from types import SimpleNamespace

    import torch

    from disttrain.rundir import RunWriter
    from disttrain.train.telemetry import StepTelemetry

    rt = SimpleNamespace(rank=0, world_size=1, is_rank0=True, distributed=False,
                         device=torch.device("cpu"), all_gather_object=lambda obj: [obj],
                         print0=print)
    writer = RunWriter(tmp_path)
    tel = StepTelemetry()
    tel.attach(rt, None, tmp_path, writer)  # type: ignore[arg-type]
    timer = tel.timer
    for i, _ in enumerate(tel.epoch(range(4), samples=0)):
        timer.compute_start()
        timer.compute_end()
        timer.optimizer_start()
        timer.optimizer_end()
        if i % 2:
            tel.log(0, i + 1, torch.tensor(0.5 * i), 0.1, samples=8 * (i + 1))
    assert [r.step for r in tel.records] == [2, 4]
    assert tel.records[0].times.step_ms >= 0 and tel.records[0].lr == 0.1
    live = json.loads((tmp_path / "live" / "rank-0.json").read_text())
    assert (live["step"], live["loss"], live["done"]) == (4, 1.5, False) and set(STEP_KEYS) <= live.keys()
    tel.flush()
    assert tel.records == []
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["rank"], r["step"], r["loss"]) for r in rows] == [
        ("train", 0, 2, 0.5), ("train", 0, 4, 1.5)]
    assert all(list(r)[:7] == ["split", "rank", "epoch", "step", "loss", "lr", "samples_per_s"]
               and tuple(list(r)[7:]) == STEP_KEYS for r in rows)
    breakdown = tel.finish(samples_per_s=123.45)
    assert breakdown["straggler"] is None
    (mine,) = breakdown["ranks"]
    assert mine["rank"] == 0 and mine["samples_per_s"] == 123.5 and set(STEP_KEYS) <= mine.keys()
    tel.close()
    writer.close()
    assert json.loads((tmp_path / "live" / "rank-0.json").read_text())["done"] is True


@pytest.mark.parametrize("intervals", [1, 2])
def test_no_whole_run_verdict_from_the_first_interval_alone(tmp_path, intervals):
    """A run of one logging interval has only its first steps (lazy initialisation): the
    summary names nobody from those, however far apart the ranks are; from a second
    interval on, the same gap is a verdict."""
    from types import SimpleNamespace

    import torch

    from disttrain.train.telemetry import StepTelemetry

    slow_peer = _rank(1, compute=40.0, comm=1.0, device="cpu")
    rt = SimpleNamespace(rank=0, world_size=2, is_rank0=True, distributed=False,
                         device=torch.device("cpu"), all_gather_object=lambda obj: [obj, slow_peer],
                         print0=print)
    tel = StepTelemetry()
    tel.attach(rt, None, tmp_path, None)  # type: ignore[arg-type]
    timer = tel.timer
    for _ in tel.epoch(range(intervals), samples=0):   # one step per interval
        timer.compute_start()
        timer.compute_end()
        timer.optimizer_start()
        timer.optimizer_end()
        timer.interval()
    assert timer.steady is (intervals > 1)
    verdict = tel.finish(samples_per_s=1.0)["straggler"]
    assert (verdict is None) is (intervals == 1)
    if verdict is not None:
        assert (verdict["rank"], verdict["cause"]) == (1, "compute")
