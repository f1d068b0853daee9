"""Every error disttrain raises on purpose, under one base.

A `DisttrainError` carries a message meant for the user: it names the field, flag, file or
rank and the fix. The CLI prints it as one line and exits 2 (bad input, or a job that cannot
run as asked) or 1 where the verb says so (a cluster call or a job that failed); anything
else that escapes is a bug and keeps its traceback. The builtin base each kind also derives
from (ValueError for input, RuntimeError for the environment) lets plain-Python callers
catch them the way they would catch the standard error of that kind.

How a job failed travels typed, from where it is detected to the CLI's message and exit
status, never re-read from text: an error raised in a rank has a `FailureKind` (its class's
`kind`; anything else is a crash), the rank writes it as a `Failure` record into the run
dir (`rundir.write_failure`), the launcher puts it on the failed rank's `RankFailure`
(`launch/result.py`), and `disttrain run` looks the kind up in `OUTCOMES`: one table for
the exit status and whether the message alone says it all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, ClassVar

# The exit status of a job that was asked to stop (SIGTERM / SIGINT: preemption, eviction,
# Ctrl-C) and stopped cleanly at an optimizer step with a checkpoint: neither a failure nor
# success, "resume me" (EX_TEMPFAIL of sysexits.h). Rendered Jobs treat it as a disruption,
# not a failure (docs/resilience.md).
EXIT_STOPPED = 75


class FailureKind(str, Enum):
    """What ended a job, as the place that detected it knows it."""

    TASK = "task"              # the user's task cannot be trained (TaskError: a factory, a batch, a loss)
    CHECKPOINT = "checkpoint"  # a checkpoint not written or not usable (CheckpointError: a full disk)
    # the checkpoint to resume from is another model's (IncompatibleCheckpoint): bad input
    INCOMPATIBLE_CHECKPOINT = "incompatible_checkpoint"
    STALL = "stall"            # a rank made no progress for the timeout (the stall watchdog)
    # a whole host gone: its pod killed by SIGKILL at once (run-local), or nothing arrives
    # from it any more (the watchdog: a lost node or a partition)
    LOST_HOST = "lost_host"
    STOPPED = "stopped"        # SIGTERM / SIGINT, and the ranks stopped at a step with a checkpoint
    # SIGTERM / SIGINT that ended the job without a checkpoint of this stop (or a script's
    # ranks, whose handling of it is their own): 128 + signum, as a shell reports it
    INTERRUPTED = "interrupted"
    # SIGTERM / SIGINT after the last step: the run had finished; said, and exit 0
    STOPPED_AFTER_END = "stopped_after_end"
    CRASH = "crash"            # anything else: an exception, a signal, an exit status


@dataclass(frozen=True)
class Outcome:
    """How `disttrain run` ends for one kind of failure.

    Attributes:
        exit_code: the exit status; None: the job's own (a crash's exit status; a stop
            signal's 128 + signum).
        alone: the failure's message says all the user needs: printed as one line, without
            the failed-ranks line and the log diagnosis.
        prefix: what the line starts with ("error: "; a stop is news, not an error: "").
    """

    exit_code: int | None
    alone: bool
    prefix: str = "error: "

    def line(self, message: str) -> str:
        """The one line `disttrain run` says for a failure whose message is `message`."""
        return f"{self.prefix}{message}"


# The CLI's one table: kind -> exit status and how it is said (cli/run_cmd.py).
OUTCOMES: dict[FailureKind, Outcome] = {
    FailureKind.TASK: Outcome(2, alone=True),          # like bad input: the message names the fix
    FailureKind.CHECKPOINT: Outcome(1, alone=True),    # the writer's line: path, bytes needed and free
    # the keys and shapes that differ, and the fix (another run dir, or no --resume)
    FailureKind.INCOMPATIBLE_CHECKPOINT: Outcome(2, alone=True),
    FailureKind.STALL: Outcome(1, alone=False),        # the watchdog's line leads the diagnosis
    FailureKind.LOST_HOST: Outcome(1, alone=False),    # the host's line (and its ranks) leads it
    # "stopped by SIGTERM at step 40, ...; resume with: ..."
    FailureKind.STOPPED: Outcome(EXIT_STOPPED, alone=True, prefix=""),
    FailureKind.INTERRUPTED: Outcome(None, alone=True, prefix=""),
    FailureKind.STOPPED_AFTER_END: Outcome(0, alone=True, prefix=""),
    FailureKind.CRASH: Outcome(None, alone=False),
}


@dataclass(frozen=True)
class Failure:
    """One rank's failure, typed: what a rank records and a launcher reads back.

    Attributes:
        kind: what failed (`FailureKind`).
        message: the error's own message, for the user (no type name, no traceback).
        rank: the global rank that failed (None: not known, e.g. before the process group).
        error: the exception's type name (`ValueError`), for a crash's line.
        pid: the process that recorded it.
    """

    kind: FailureKind
    message: str
    rank: int | None = None
    error: str = ""
    pid: int | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int | None = None,
                       pid: int | None = None) -> Failure:
        """The failure `exc` stands for: its class's `kind`, a crash for any other error."""
        kind = getattr(type(exc), "kind", None)
        return cls(kind if isinstance(kind, FailureKind) else FailureKind.CRASH, str(exc), rank,
                   type(exc).__name__, pid)

    @property
    def outcome(self) -> Outcome:
        return OUTCOMES[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: Any) -> Failure | None:
        """A record as written by `to_dict`, or None when it is not one (a torn write, another
        version's file): the launcher then knows only the exit status, as without a record."""
        if not isinstance(data, dict) or not isinstance(data.get("message"), str):
            return None
        try:
            kind = FailureKind(data.get("kind"))
        except ValueError:
            return None
        rank, pid = data.get("rank"), data.get("pid")
        return cls(kind, data["message"], rank if isinstance(rank, int) else None,
                   str(data.get("error") or ""), pid if isinstance(pid, int) else None)


class DisttrainError(Exception):
    """Base of every error disttrain raises on purpose; the message is for the user."""

    # The kind of job failure this error is when a rank raises it (None: a crash).
    kind: ClassVar[FailureKind | None] = None


# -- bad input: the spec, a flag, a file, a script ------------------------------------------
class SpecError(DisttrainError, ValueError):
    """A spec, flag or file that cannot be used; the message names it and the fix."""


class CodeError(SpecError):
    """Code that cannot be shipped to a pod; the message names the field and the fix."""


class TorchVersionError(SpecError):
    """A job that needs a newer torch than the one it would run on; names the feature."""


class LintError(DisttrainError):
    """A script that cannot be read or parsed; the message names the file (and line)."""


class StrategyError(DisttrainError, ValueError):
    """A strategy that cannot run as asked; the message names the fix."""


class PrecisionError(DisttrainError, ValueError):
    """A precision this device cannot run."""


# -- the environment: this machine, its variables, its files ---------------------------------
class DistEnvError(DisttrainError, RuntimeError):
    """The distributed environment variables are missing or malformed."""


class LaunchError(DisttrainError, RuntimeError):
    """The job cannot be started as asked (e.g. an explicitly requested port is taken)."""


class PortTaken(LaunchError):
    """The rendezvous port was taken between choosing it and binding it."""


class RunDirError(DisttrainError, ValueError):
    """A run directory that holds no run, or not yet the file asked for; names the file."""


class DatasetError(DisttrainError, RuntimeError):
    """A dataset that is missing or unreadable; the message says where it looked."""


class CheckpointError(DisttrainError, RuntimeError):
    """A checkpoint that cannot be used (corrupt, truncated, or from another job)."""

    kind = FailureKind.CHECKPOINT


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint to resume from was saved from another model (keys or shapes differ):
    the message names the file, a few keys of each difference and the fix; exit 2."""

    kind = FailureKind.INCOMPATIBLE_CHECKPOINT


class BenchError(DisttrainError, RuntimeError):
    """A benchmark run failed; the message names the rank or the command and its output."""


# -- the cluster --------------------------------------------------------------------------
class KubeError(DisttrainError, RuntimeError):
    """A cluster operation failed; the message says what and what to check."""


class LocalRunError(DisttrainError, RuntimeError):
    """run-local cannot run here, or the rendered pods cannot be emulated; says why."""


# -- a job that failed while running ---------------------------------------------------------
class RankStalled(DisttrainError, RuntimeError):
    """A rank made no progress for longer than the timeout; rank 0's watchdog records it in
    torchrun's error file before it ends the job (docs/resilience.md)."""

    kind = FailureKind.STALL


class HostLost(RankStalled):
    """Nothing arrives any more from the host of a rank that made no progress (a lost node,
    or a partition); recorded like a stall, as the kind of failure it is."""

    kind = FailureKind.LOST_HOST
