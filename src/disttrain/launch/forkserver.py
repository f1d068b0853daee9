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

`disttrain run` asks for the server with `share_torch=True`: it imports torch itself
first, and the server is then a fork of it (`_server_forked_here`) instead of a new
interpreter that imports torch a second time. That is ~2 s of CPU less per job (and per
pod), which a pod with a CPU limit, or any busy machine, pays in wall time
(docs/performance.md, "On by default"). It is done only in a process that had not imported
torch before and runs no other thread, so nothing of torch has run yet (no OpenMP team)
and no lock can be held at the fork: the state the exec'd server is in after its own
`import torch`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from disttrain import envvars

PRELOAD_MODULE = "disttrain.launch.forkserver_preload"


def prewarm_workers(task: dict[str, Any] | None = None, *, share_torch: bool = False,
                    share_imports: Sequence[str] = ()) -> bool:
    """Start the warm fork server for built-in-job workers (see `disttrain.launch.forkserver_preload`).

    Call early in the launcher: without `share_torch`, before it imports torch, so both
    imports overlap. Returns False where fork servers do not exist (non-POSIX).

    Args:
        task: the job's task, `{"ref": ..., "args": task_args}`, whose warm hook
            (`disttrain.train.task.warm_task`) the server runs to load its data once for all
            its forks; only the call that starts the server passes it on.
        share_torch: import torch here and start the server as a fork of this process,
            so that both share that one import; ignored (a new interpreter, as
            multiprocessing starts it) where torch is imported already or another thread
            runs (`_may_fork_server`).
    """
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
    if task is not None:  # the server inherits this environment when it starts
        envvars.set_env(envvars.WARM_TASK, json.dumps(task))
    fork_here = share_torch and _may_fork_server()
    if fork_here:
        import importlib

        import torch  # noqa: F401  (the import the server shares)

        for module in share_imports:
            importlib.import_module(module)
    try:
        with _server_forked_here() if fork_here else contextlib.nullcontext():
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


def _may_fork_server() -> bool:
    """Whether this process may become the server's parent by fork: torch not imported
    yet (so none of it has run, and no OpenMP team exists to be broken in the child) and
    no thread but this one (none can hold a lock the child would inherit held)."""
    return "torch" not in sys.modules and threading.active_count() == 1


@contextlib.contextmanager
def _server_forked_here() -> Iterator[None]:
    """While multiprocessing's `ForkServer.ensure_running` runs, start the server by
    forking this process instead of executing a new interpreter.

    `ensure_running` makes the server's listening socket and liveness pipe, then hands
    `util.spawnv_passfds(exe, args, fds)` a `-c` program that calls
    `multiprocessing.forkserver.main(...)`; here the child of a fork runs that same
    program, keeping only `fds` and stdin/stdout/stderr as the new interpreter would.
    Everything else (the socket, the pipe, the pid it records, how it is stopped) stays
    multiprocessing's own. The resource tracker it also starts is left to `spawnv_passfds`.
    """
    from multiprocessing import util

    exec_server = util.spawnv_passfds

    def fork_server(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        program = args[-1]
        if "multiprocessing.forkserver import main" not in program:
            return exec_server(path, args, passfds)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with warnings.catch_warnings():
            # 3.12+: "process is multi-threaded": the one other thread is numpy's OpenBLAS
            # pool, which re-creates itself in a child (pthread_atfork), as it does in every
            # worker the server forks
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return pid
        _run_server(program, passfds)   # never returns
        return 0

    util.spawnv_passfds = fork_server
    try:
        yield
    finally:
        util.spawnv_passfds = exec_server


def _run_server(program: str, passfds: Sequence[int]) -> None:
    """The forked server: only its own fds open, a lock of its own, then
    multiprocessing's server loop (`program`); it ends with os._exit, as the preload's
    last act does (`disttrain.launch.forkserver_preload`)."""
    import multiprocessing.forkserver as forkserver

    from disttrain.resilience.proctitle import set_server_title
    from disttrain.resilience.watchdog import exit_now

    code = 0
    try:
        set_server_title(os.getppid())   # not the launcher's command line, copied by the fork
        keep = sorted({0, 1, 2, *passfds})   # every other fd closed, as close_fds does
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        # held by the parent's ensure_running at the fork: a worker that starts a fork
        # server of its own (a forkserver DataLoader) would wait on it forever
        forkserver._forkserver._lock = threading.Lock()
        exec(compile(program, "<forkserver>", "exec"), {"__name__": "__forkserver__"})
    except SystemExit as exc:   # the loop's end: its parent closed the liveness pipe
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)
