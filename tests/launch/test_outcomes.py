"""The stop and the lost host as typed failures (issue 21 item 3): each fault is injected
where it is detected (rank 0's stop record and the launcher's signal; a remote rank whose
heartbeats stop arriving; an emulated pod SIGKILLed as a whole) and must reach
`disttrain run`'s / `k8s run-local`'s line and exit status through its kind's row in
`errors.OUTCOMES`, not through its text. The end-to-end runs with real ranks are in
tests/resilience/test_preemption.py (a stop) and test_hosts.py (a lost host)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from disttrain.cli.run_cmd import _report_failure, _say_alone
from disttrain.errors import EXIT_STOPPED, OUTCOMES, Failure, FailureKind, HostLost, RankStalled
from disttrain.k8s import local
from disttrain.k8s.local import LocalPod, LocalResult
from disttrain.launch.launchers import _add_stalls
from disttrain.launch.result import LaunchResult, RankFailure
from disttrain.resilience.preemption import stop_failure, write_stop_record
from disttrain.resilience.watchdog import Watchdog

RESUME = "disttrain run --resume"


def test_a_clean_stop_is_stopped_and_exits_75_with_its_line_alone(tmp_path, capsys):
    write_stop_record(tmp_path, signal.SIGTERM, step=40, epoch=2, checkpoint=tmp_path / "last.pt")
    stop = stop_failure(tmp_path, signal.SIGTERM, script=False, resume_cmd=RESUME)
    assert stop is not None and stop.kind == FailureKind.STOPPED
    # the launcher's own status (143) is not what a clean stop exits with
    assert _say_alone(stop, LaunchResult.stopped(signal.SIGTERM).exit_code) == EXIT_STOPPED
    err = capsys.readouterr().err
    assert err.startswith("stopped by SIGTERM at step 40, epoch 2; checkpoint at ")
    assert err.rstrip().endswith(f"resume with: {RESUME}") and "error:" not in err


@pytest.mark.parametrize("script", [False, True])
def test_a_stop_without_a_checkpoint_is_interrupted_and_exits_128_plus_signum(tmp_path, script, capsys):
    stop = stop_failure(tmp_path, signal.SIGINT, script=script, resume_cmd=RESUME)
    assert stop is not None and stop.kind == FailureKind.INTERRUPTED
    assert _say_alone(stop, LaunchResult.stopped(signal.SIGINT).exit_code) == 128 + signal.SIGINT
    assert capsys.readouterr().err.startswith("stopped by SIGINT")


def test_a_signal_after_the_last_step_is_said_and_exits_0(tmp_path, capsys):
    since = time.time() - 5
    (tmp_path / "summary.json").write_text('{"stopped": false}')
    stop = stop_failure(tmp_path, signal.SIGTERM, script=False, resume_cmd=RESUME, since=since)
    assert stop is not None and stop.kind == FailureKind.STOPPED_AFTER_END
    assert _say_alone(stop, LaunchResult.stopped(signal.SIGTERM).exit_code) == 0
    assert "the run had finished" in capsys.readouterr().err


def test_no_signal_and_no_record_is_no_stop(tmp_path):
    assert stop_failure(tmp_path, 0, script=False, resume_cmd=RESUME) is None


def _remote(step: int, alive: int) -> dict:
    return {"rank": 1, "pid": 4242, "host": "trainer-1", "step": step, "phase": "backward",
            "seq": step, "alive": alive}


def _watchdog() -> Watchdog:
    return Watchdog("127.0.0.1", 1, world_size=2, timeout_s=10, interval=1, kill=False)


def test_a_host_that_goes_silent_is_a_lost_host_where_the_watchdog_sees_it(capsys):
    wd = _watchdog()
    for t in range(5):                      # rank 1 on another host publishes, then nothing
        wd.observe({1: _remote(9, t)}, now=t)
    stall = wd.judge(now=20)
    assert stall is not None and stall.kind == FailureKind.LOST_HOST
    assert isinstance(stall.error(), HostLost)
    assert Failure.from_exception(stall.error()).kind == FailureKind.LOST_HOST   # as rank 0 records it
    # the launcher types the rank the watchdog named; `disttrain run` exits by the table
    result = LaunchResult.failed({0: RankFailure("stopped", exitcode=-15)}, exit_code=1)
    _add_stalls(result, [stall])
    assert result.failures[1].kind == FailureKind.LOST_HOST
    assert _report_failure(result) == OUTCOMES[FailureKind.LOST_HOST].exit_code == 1
    err = capsys.readouterr().err
    assert "nothing arrives from host trainer-1" in err and "failed rank(s): 1" in err


def test_a_remote_rank_alive_but_stuck_stays_a_stall():
    wd = _watchdog()
    for t in range(25):                     # publisher alive, no progress
        wd.observe({1: _remote(9, t)}, now=t)
    stall = wd.judge(now=24)
    assert stall is not None and stall.kind == FailureKind.STALL
    assert type(stall.error()) is RankStalled


def test_a_pod_killed_as_a_whole_is_a_lost_host_and_run_local_exits_by_the_table(tmp_path, monkeypatch):
    """`_supervise` with the pods as plain processes (no namespaces): pod trainer-1 is
    SIGKILLed, as `netns.lose_host` kills a host; trainer-0 fails after it (as a rank
    whose peer is gone does)."""
    programs = {"trainer-0": "sleep 1; exit 1", "trainer-1": "kill -9 $$"}

    def start(self, pod, mapping):
        proc = subprocess.Popen(["sh", "-c", programs[pod.name]], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs[pod.name] = proc
        self.tails.setdefault(pod.name, [])

    monkeypatch.setattr(local._Pods, "start", start)
    pods = [LocalPod(n, n, (n,), f"198.18.0.{i + 1}", (), {}, None, (), {})
            for i, n in enumerate(programs)]
    result = local._supervise([(p, {}) for p in pods], {}, tmp_path, out=lambda line: None,
                              timeout_s=60, grace_s=5)
    lost = result.lost["trainer-1"]
    assert lost.kind == FailureKind.LOST_HOST
    assert lost.outcome.line(lost.message).startswith("error: host trainer-1 lost: pod trainer-1 "
                                                      "was killed by SIGKILL")
    assert result.exit_codes["trainer-1"] == 137   # the pod's own status stays on record
    assert result.exit_code == OUTCOMES[FailureKind.LOST_HOST].exit_code == 1


def test_a_failed_pod_without_a_lost_host_keeps_its_own_exit_status():
    assert LocalResult({"a": 0, "b": 3}).exit_code == 3
    assert LocalResult({"a": 3}, timed_out=True).exit_code == 124


def test_every_kind_has_a_row_and_stops_are_not_errors():
    assert set(OUTCOMES) == set(FailureKind)
    for kind in (FailureKind.STOPPED, FailureKind.INTERRUPTED, FailureKind.STOPPED_AFTER_END):
        assert OUTCOMES[kind].alone and OUTCOMES[kind].prefix == ""
    assert OUTCOMES[FailureKind.INTERRUPTED].exit_code is None   # the launcher's 128 + signum
