"""How a local launch ended: one result type for every launcher, one record per failed rank.

    result = launch(spec)                         # LaunchResult(exit_code=1, failures={1: ...})
    result.failures[1].summary()                  # 'rank crashed (exit code 1): ValueError: boom'
    result = launch_function(spec, fn, arg)       # result.values == {0: fn(arg), 1: fn(arg)}

torchrun's agent, mp.spawn and the in-process `env` launcher each report failures in
their own shape (torch's ProcessFailure, ProcessRaisedException / ProcessExitedException,
a Python exception); each is turned into a `RankFailure` here, so `disttrain run`,
`disttrain verify` and the benchmarks read one shape. A failure's kind (`errors.FailureKind`)
comes typed: from the record the rank wrote (`with_record`), or from the launcher's own
finding (a stall); never from the text. stdlib only: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from disttrain.errors import Failure, FailureKind

# torch's message when a rank wrote no error file (it died outside @record): says nothing
# about this failure, so it is left out of the one-line summary.
_NO_ERROR_FILE_HINT = "To enable traceback"


@dataclass
class RankFailure:
    """How one rank failed, as far as its launcher could tell.

    Attributes:
        message: the rank's error (a traceback's text when it wrote an error file).
        exitcode: the process's exit status (negative: killed by that signal), when known.
        host: the machine it ran on; pid, local_rank, error_file: where torch's agent saw it.
        kind: what failed: the rank's own record's kind, STALL when the launcher's watchdog
            killed it for making no progress, else CRASH.
        record: the failure the rank recorded itself (`errors.Failure`), when it did.
    """

    message: str = ""
    exitcode: int | None = None
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    error_file: str | None = None
    kind: FailureKind = FailureKind.CRASH
    record: Failure | None = None

    def with_record(self, record: Failure) -> RankFailure:
        """This failure with what the rank recorded of it: its kind and its message."""
        return replace(self, kind=record.kind, record=record)

    @classmethod
    def from_elastic(cls, failure: Any, host: str | None = None) -> RankFailure:
        """From torch's `ProcessFailure` (a `ChildFailedError`'s failures), whose message
        is the text of the rank's error file or, in some torch versions, a dict holding it."""
        message = getattr(failure, "message", "") or ""
        if isinstance(message, dict):
            message = message.get("message", "")
        return cls(message=str(message), exitcode=failure.exitcode, host=host,
                   pid=getattr(failure, "pid", None), local_rank=failure.local_rank,
                   error_file=failure.error_file)

    def summary(self) -> str:
        """One line: the exit code and the last line of the error (what verify and bench show)."""
        text = self.message.strip()
        last = text.splitlines()[-1] if text else ""
        if _NO_ERROR_FILE_HINT in last:
            last = ""
        return f"rank crashed (exit code {self.exitcode}){': ' + last if last else ''}"


@dataclass
class LaunchResult:
    """What every launcher returns.

    Attributes:
        exit_code: 0 when every rank succeeded, else the job's exit status.
        values: each rank's return value by global rank (function launches; local ranks).
        failures: the failed ranks by global rank.
        notes: things the user should know (a master port that moved).
        log_text: the text for `disttrain doctor`-style diagnosis of a failure.
        stalls: the watchdog's reports, one line per stalled rank.
        signal: the signal (SIGTERM / SIGINT) that stopped the launcher and, through it,
            the ranks (0: none; `disttrain.resilience.preemption`).
    """

    exit_code: int = 0
    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    log_text: str = ""
    stalls: list[str] = field(default_factory=list)
    signal: int = 0

    @classmethod
    def failed(cls, failures: dict[int, RankFailure], log_text: str = "",
               exit_code: int = 1) -> LaunchResult:
        """A job that ended with `failures`."""
        return cls(exit_code=exit_code, failures=failures, log_text=log_text)

    @classmethod
    def stopped(cls, signum: int) -> LaunchResult:
        """A launch stopped by `signum`: exit status 128 + signum unless the caller finds
        the ranks' record of a clean stop (`disttrain.resilience.preemption`)."""
        return cls(exit_code=128 + signum, signal=signum)


def typed_failures(failures: dict[int, RankFailure], records: list[Failure]) -> dict[int, RankFailure]:
    """`failures` with the records their ranks wrote (`rundir.read_failures`): matched by
    process id, so a record of an earlier round of a restarted job never types a later
    failure of the same rank; by rank where the launcher knows no pid (`env`)."""
    by_pid = {r.pid: r for r in records if r.pid is not None}
    by_rank = {r.rank: r for r in records if r.rank is not None}
    typed = {}
    for rank, failure in failures.items():
        record = by_pid.get(failure.pid) if failure.pid is not None else by_rank.get(rank)
        typed[rank] = failure.with_record(record) if record is not None and failure.record is None \
            else failure
    return typed


def peer_failures(failures: dict[int, RankFailure], records: list[Failure]) -> dict[int, RankFailure]:
    """Ranks that recorded a failure of a kind of their own (a task error, a checkpoint not
    written...) but that torch's agent does not list as failed: it saw another rank fail
    first (one whose collective broke when this one left) and stopped this one, maybe
    while it was exiting. Their records are the cause; the listed rank's crash is its
    consequence (issue 21: `mytask:not_a_task` reported as rank 0's "Connection closed by
    peer", exit 1, under load). Only for a job of one round (no restarts): a record of an
    earlier round would otherwise be taken for this one's."""
    found: dict[int, RankFailure] = {}
    for record in records:
        if record.rank is None or record.rank in failures or record.kind is FailureKind.CRASH:
            continue
        found[record.rank] = RankFailure(record.message, pid=record.pid).with_record(record)
    return found
