"""The warm fork server that local workers are forked from.

    prewarm_workers({"ref": "disttrain.examples.digits:make_task", "args": {}})   # early in
                                                  # `disttrain run`, before torch
    method = worker_start_method()                # "forkserver" (warm) or "spawn"
    stop_prewarmed()                              # the job was refused before its launch

multiprocessing's fork server is started with `disttrain.launch.forkserver_preload` as
its preload, so it imports torch (and the built-in job's modules) on one core while the
launcher imports torch on another; workers started with start method "forkserver" are
then forks of that warm process and start at once. What the preload does, and why, is in
that module's docstring; it is a module of its own because importing it runs it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from disttrain import envvars

PRELOAD_MODULE = "disttrain.launch.forkserver_preload"


def prewarm_workers(task: dict[str, Any] | None = None) -> bool:
    """Start the warm fork server for built-in-job workers (see `disttrain.launch.forkserver_preload`).

    Call before importing torch in the launcher, so both imports overlap. Returns False
    where fork servers do not exist (non-POSIX).

    Args:
        task: the job's task, `{"ref": ..., "args": task_args}`, whose warm hook
            (`disttrain.train.task.warm_task`) the server runs to load its data once for all
            its forks; only the call that starts the server passes it on.
    """
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
    if task is not None:  # the server inherits this environment when it starts
        envvars.set_env(envvars.WARM_TASK, json.dumps(task))
    try:
        forkserver.ensure_running()
    except OSError as exc:
        # Its socket lives in multiprocessing's temp folder under TMPDIR: a TMPDIR over ~80
        # characters makes "AF_UNIX path too long" (Python < 3.13 does not fall back to /tmp).
        _say_once(f"note: the warm worker server could not start ({exc}; TMPDIR="
                  f"{os.environ.get('TMPDIR', '')!r}); workers start with 'spawn', each "
                  "importing torch itself: a shorter TMPDIR makes them start faster")
        return False
    finally:
        os.environ.pop(envvars.WARM_TASK, None)
    return True


_said: set[str] = set()


def _say_once(note: str) -> None:
    import sys

    if note not in _said:
        _said.add(note)
        print(note, file=sys.stderr, flush=True)


def worker_start_method() -> str:
    """The start method for local workers: "forkserver" once the warm server runs (it is
    started here if it is not yet), "spawn" where there are no fork servers."""
    return "forkserver" if prewarm_workers() else "spawn"


def stop_prewarmed() -> None:
    """Kill the warm fork server now: for a job refused after `prewarm_workers` (bad input,
    a taken port). Left alone it would spend seconds of a core finishing its imports of
    torch and the task before it saw that its launcher had gone."""
    import contextlib
    import multiprocessing.forkserver as forkserver
    import signal

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()   # reaps it, closes the pipe, removes its socket file
