"""Typed failures: a failure's kind is set where it is detected (the exception's class in a
rank, the launcher's stall watchdog), travels as a record (`errors.Failure` in the run
dir, `RankFailure.kind` on the launcher's result) and reaches `disttrain run`'s message and
exit status through one table (`errors.OUTCOMES`), never re-read from text. One process:
the multi-process paths are in tests/cli/test_run_task.py (a task error, torchrun and
spawn), tests/resilience/test_resilience.py (a stall) and test_preemption.py (a stop)."""

from __future__ import annotations

import logging

import pytest

from disttrain.cli.run_cmd import _report_failure
from disttrain.errors import (
    EXIT_STOPPED,
    OUTCOMES,
    CheckpointError,
    Failure,
    FailureKind,
    RankStalled,
)
from disttrain.launch.agent_logs import quiet_reported_failures
from disttrain.launch.result import LaunchResult, RankFailure, peer_failures, typed_failures
from disttrain.rundir import FAILURES, clear_failures, read_failures, write_failure
from disttrain.train.task import TaskError


def test_the_kind_comes_from_the_exception_class_and_every_kind_has_an_outcome():
    assert Failure.from_exception(TaskError("no data"), 1, 7) == Failure(
        FailureKind.TASK, "no data", 1, "TaskError", 7)
    assert Failure.from_exception(CheckpointError("disk full")).kind == FailureKind.CHECKPOINT
    assert Failure.from_exception(RankStalled("rank 1 ...")).kind == FailureKind.STALL
    assert Failure.from_exception(ValueError("boom")).kind == FailureKind.CRASH
    assert set(OUTCOMES) == set(FailureKind)
    codes = (OUTCOMES[FailureKind.TASK].exit_code, OUTCOMES[FailureKind.STOPPED].exit_code)
    assert codes == (2, EXIT_STOPPED)
    assert OUTCOMES[FailureKind.CRASH].exit_code is None   # the job's own exit status


def test_records_round_trip_through_the_run_dir_and_torn_ones_are_skipped(tmp_path):
    task = Failure(FailureKind.TASK, "no data at /data", 0, "TaskError", 101)
    write_failure(tmp_path, task)
    write_failure(tmp_path, Failure(FailureKind.CRASH, "boom", None, "ValueError", 102))
    (tmp_path / FAILURES / "rank-9.json").write_text('{"kind": "task", "mess')   # torn
    (tmp_path / FAILURES / "rank-8.json").write_text('{"kind": "nope", "message": "x"}')
    crash = Failure(FailureKind.CRASH, "boom", None, "ValueError", 102)   # rank unknown: by pid
    assert sorted(read_failures(tmp_path), key=lambda f: f.message) == [crash, task]
    clear_failures(tmp_path)
    assert read_failures(tmp_path) == [] and not (tmp_path / FAILURES).exists()
    (tmp_path / "file").write_text("a file where the run dir's parent would be")
    write_failure(tmp_path / "file" / "x", task)   # unwritable: no error, no record
    assert read_failures(tmp_path / "file" / "x") == []


def test_a_rank_failure_takes_its_own_record_by_pid_never_an_earlier_rounds():
    task = Failure(FailureKind.TASK, "bad batch", 1, "TaskError", 202)
    earlier = Failure(FailureKind.TASK, "old", 0, "TaskError", 100)   # a restarted job's first round
    failures = {0: RankFailure("Signal 9", exitcode=-9, pid=201), 1: RankFailure("...", exitcode=1, pid=202)}
    typed = typed_failures(failures, [earlier, task])
    assert typed[0].kind == FailureKind.CRASH and typed[0].record is None
    assert (typed[1].kind, typed[1].record) == (FailureKind.TASK, task)
    assert typed[1].message == "..."   # the launcher's text stays for the diagnosis
    no_pid = typed_failures({0: RankFailure("x")}, [earlier])   # the env launcher: by rank
    assert no_pid[0].kind == FailureKind.TASK


class _Raised(Exception):
    error_pid = 303


def _agent_record(exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR,
                             __file__, 1, "failed (exitcode: %s)", (1,), info)


def test_torchs_agent_log_of_a_worker_is_dropped_only_when_its_record_says_the_cli_reports_it(tmp_path):
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with quiet_reported_failures(tmp_path):
        assert agent.filter(_agent_record(_Raised()))          # no record: torch logs it
        write_failure(tmp_path, Failure(FailureKind.CRASH, "boom", 0, "ValueError", 303))
        assert agent.filter(_agent_record(_Raised()))          # a crash: its traceback is wanted
        write_failure(tmp_path, Failure(FailureKind.TASK, "no data", 0, "TaskError", 303))
        assert not agent.filter(_agent_record(_Raised()))      # said once by `disttrain run`
        assert agent.filter(_agent_record(None))                # not a worker's failure
    assert agent.filter(_agent_record(_Raised()))               # the filter ends with the launch


@pytest.mark.parametrize(("kind", "code", "alone"), [
    (FailureKind.TASK, 2, True), (FailureKind.CHECKPOINT, 1, True), (FailureKind.CRASH, 1, False)])
def test_the_cli_says_each_kind_by_the_table(kind, code, alone, capsys):
    record = Failure(kind, "what went wrong", 0, "Err", 11)
    failed = RankFailure("Err: what went wrong", exitcode=1, pid=11).with_record(record)
    result = LaunchResult.failed({0: failed, 1: RankFailure("stopped", exitcode=-15)}, log_text="")
    assert _report_failure(result) == code
    err = capsys.readouterr().err
    assert err.count("what went wrong") == (1 if alone else 0)
    assert ("error: the job failed (failed rank(s): 0)" in err) is not alone


def test_a_stall_is_said_with_the_watchdogs_line_and_exits_1(capsys):
    line = "rank 1 (pid 5, host h) made no progress for 6 s; last seen: step 17, phase backward"
    result = LaunchResult.failed({0: RankFailure("stopped", exitcode=-15),
                                  1: RankFailure(line, exitcode=-9, kind=FailureKind.STALL)}, exit_code=1)
    result.stalls = [line]
    assert _report_failure(result) == 1
    err = capsys.readouterr().err
    assert f"error: {line}" in err and "failed rank(s): 1" in err


def _crash_and_task() -> tuple[RankFailure, Failure]:
    """Rank 1 raised TaskError and left; rank 0's collective broke then (a crash of its
    own), and torch's agent saw rank 0 fail first and stopped rank 1 (issue 21, under load)."""
    crash = Failure(FailureKind.CRASH, "Gloo connectFullMesh failed: Connection closed by peer",
                    0, "RuntimeError", 10)
    task = Failure(FailureKind.TASK, "task 'mytask:not_a_task' returned dict, not a "
                                     "disttrain.TrainTask", 1, "TaskError", 11)
    return RankFailure("RuntimeError: ...", exitcode=1, pid=10).with_record(crash), task


def test_a_peers_own_failure_is_the_cause_and_a_broken_collective_its_consequence(capsys):
    listed, task = _crash_and_task()
    peers = peer_failures({0: listed}, [listed.record, task])
    assert list(peers) == [1] and peers[1].kind is FailureKind.TASK and peers[1].record == task
    result = LaunchResult.failed({0: listed, **peers}, log_text="")
    assert _report_failure(result) == 2                 # the task's exit status, not the crash's 1
    err = capsys.readouterr().err
    assert err.count("returned dict, not a disttrain.TrainTask") == 1
    assert "the job failed" not in err and "connectFullMesh" not in err
    # a rank torchrun stopped (-15) after recording its own failure counts as well
    stopped = RankFailure("stopped", exitcode=-15, pid=11).with_record(task)
    assert _report_failure(LaunchResult.failed({0: listed, 1: stopped}, log_text="")) == 2


def test_peer_records_that_are_crashes_or_already_listed_add_nothing():
    listed, task = _crash_and_task()
    other_crash = Failure(FailureKind.CRASH, "Connection reset by peer", 1, "RuntimeError", 11)
    assert peer_failures({0: listed}, [listed.record, other_crash]) == {}
    assert peer_failures({0: listed, 1: RankFailure("x", exitcode=1, pid=11)}, [task]) == {}
    assert peer_failures({0: listed}, [Failure(FailureKind.TASK, "m", None, "TaskError", 12)]) == {}
