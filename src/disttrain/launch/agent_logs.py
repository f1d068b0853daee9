"""What torch's elastic agent logs while disttrain launches, kept off the output where
`disttrain run` says it better itself.

    with quiet_agent_stop(), quiet_reported_failures(run_dir):
        elastic_launch(config, entry)(...)

Two filters on torch's own loggers, removed when the block ends: the agent's warnings while
it forwards a stop signal (`disttrain run` says the stop in one line), and its log of a
failed worker with the traceback of disttrain's frames when the worker's typed failure
record says `disttrain run` reports it in one line (`errors.OUTCOMES`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from disttrain.rundir import read_failures

# What torch's agent logs while it forwards a stop signal to the workers: `disttrain run`
# says it in one line instead.
# A worker that outlives the grace and is SIGKILLed is still reported (torch's warning).
_AGENT_STOP_LINES = ("death signal, shutting down workers", "closing signal", "Closing process")


@contextlib.contextmanager
def quiet_agent_stop() -> Iterator[None]:
    """Keep torch's agent's warnings about a stop signal it forwards off the output."""
    def keep(record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(part in text for part in _AGENT_STOP_LINES)

    with _filtered((_AGENT_LOGGER, _WORKERS_LOGGER), keep):
        yield


# torch's agent, and its logger that reports a failed worker with the worker's traceback
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
_WORKERS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


@contextlib.contextmanager
def quiet_reported_failures(run_dir: Path) -> Iterator[None]:
    """Keep torch's agent from logging, with the traceback of disttrain's frames, a worker
    whose recorded failure `disttrain run` says in one line itself (`errors.OUTCOMES`:
    the user's task, a checkpoint not written). Decided from the worker's typed record
    (`rundir.read_failures`, matched by pid), not from the text; any other failure is
    logged as torch logs it."""
    def keep(record: logging.LogRecord) -> bool:
        pid = getattr(record.exc_info[1], "error_pid", None) if record.exc_info else None
        if pid is None:
            return True
        failure = next((f for f in read_failures(run_dir) if f.pid == pid), None)
        return failure is None or not failure.outcome.alone

    with _filtered((_WORKERS_LOGGER,), keep):
        yield


@contextlib.contextmanager
def _filtered(names: Sequence[str], keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    for log in loggers:
        log.addFilter(keep)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(keep)


# What torch's agent logs when a worker fails: its traceback as the agent saw it (~60 lines
# for a forked worker) and the stop of the other workers. `disttrain run` prints its own
# diagnosis of the same failure last (`diagnose.logs`); these lines go to a file instead.
_FAILURE_LINES = ("failed (exitcode", "Terminating process")
_SPAWN_LOGGER = "torch.multiprocessing.spawn"   # the agent's own start_processes (forked workers)
AGENT_LOG = "torchrun.log"   # in `<run_dir>/logs/`


@contextlib.contextmanager
def agent_report_to(path: Path | None) -> Iterator[list[int]]:
    """Send torch's agent's report of a failed worker (`_FAILURE_LINES`) to `path` instead
    of the terminal (issue 25 item 10); other records pass as before. Yields a list that
    holds the number of lines written, once there are any (for the note that says where)."""
    kept: list[int] = []
    if path is None:
        yield kept
        return
    handler: logging.Handler | None = None

    def divert(record: logging.LogRecord) -> bool:
        nonlocal handler
        if not any(part in str(record.msg) for part in _FAILURE_LINES):
            return True
        try:
            if handler is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                handler = logging.FileHandler(path, encoding="utf-8")
                handler.setFormatter(logging.Formatter(
                    "%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s"))
            text = handler.format(record)
            handler.handle(record)
            handler.flush()
        except OSError:
            return True   # the run dir cannot take it: the terminal shows it, as before
        kept[:] = [(kept[0] if kept else 0) + text.count("\n") + 1]
        return False

    with _filtered((_WORKERS_LOGGER, _SPAWN_LOGGER), divert):
        try:
            yield kept
        finally:
            if handler is not None:
                handler.close()
