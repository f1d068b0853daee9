"""Every error disttrain raises on purpose, under one base.

A `DisttrainError` carries a message meant for the user: it names the field, flag, file or
rank and the fix. The CLI prints it as one line and exits 2 (bad input, or a job that cannot
run as asked) or 1 where the verb says so (a cluster call or a job that failed); anything
else that escapes is a bug and keeps its traceback. The builtin base each kind also derives
from (ValueError for input, RuntimeError for the environment) lets plain-Python callers
catch them the way they would catch the standard error of that kind.
"""

from __future__ import annotations

# The exit status of a job that was asked to stop (SIGTERM / SIGINT: preemption, eviction,
# Ctrl-C) and stopped cleanly at an optimizer step with a checkpoint: neither a failure nor
# success, "resume me" (EX_TEMPFAIL of sysexits.h). Rendered Jobs treat it as a disruption,
# not a failure (docs/resilience.md).
EXIT_STOPPED = 75


class DisttrainError(Exception):
    """Base of every error disttrain raises on purpose; the message is for the user."""


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
