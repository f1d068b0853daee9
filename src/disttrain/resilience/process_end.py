"""How a disttrain process ends: what a normal Python exit does that matters, then
`os._exit`, without the interpreter's teardown of every module (docs/resilience.md,
"How a process ends").

    end_process(code)                                  # the `disttrain` command
    end_process(code, thread_grace_s=300, flush_files=True)   # a user's script rank

Why not the normal exit:
- **It can abort a finished rank.** With torch 2.13 the process group outlives
  `destroy_process_group` when torch._dynamo was first imported after the group was made
  (every optimizer imports it), and gloo's threads still hold finished work (tensors) while
  the interpreter is torn down. An unmodified script that had called destroy_process_group
  ended with "terminate called without an active exception" (SIGABRT) on one rank, and its
  job was reported failed (this project's suite, under load; the abort is reported upstream
  as pytorch/pytorch#190489, and a fix in torch, pytorch/pytorch#179291, was abandoned).
- **It is slow.** After `import torch` the teardown alone costs 0.4-0.75 s of CPU per
  process (`python -c "import torch"`: 2.58 s, with `os._exit(0)` at the end 1.83 s).

multiprocessing ends its workers the same way, and `python -m disttrain.worker` does too.
What a normal exit does that matters still happens, in Python's order (`Py_FinalizeEx`):
non-daemon threads are joined, atexit handlers run (logging's flush, multiprocessing's and
tempfile's clean-ups, the user's own), then, for a process that ran a user's code, every
open Python file is flushed (what closing it at teardown would write), then stdout and
stderr. What does not happen: finalizers (`__del__`) of objects still alive and C++ static
destructors; a file the script never closed is flushed, and the kernel closes it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import sys
import threading
import time
from typing import NoReturn

# what `open()` returns for writing; their subclasses too (checked with issubclass on the
# type: `isinstance` reads `__class__`, which some of torch's lazy objects warn about)
_WRITABLE_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def exit_status(exc: SystemExit) -> int:
    """The status `python script.py` ends with after `sys.exit(code)`: None is 0, an int is
    itself, anything else is printed to stderr (as Python prints it) and is 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr, flush=True)
    return 1


def join_threads(grace_s: float | None = None) -> list[str]:
    """Wait for the non-daemon threads, as a normal exit does (threads they start too);
    with `grace_s`, at most that long in all. Returns the names of those still running."""
    deadline = None if grace_s is None else time.monotonic() + grace_s
    while True:
        waiting = [t for t in threading.enumerate()
                   if t is not threading.main_thread() and not t.daemon and t.is_alive()]
        if not waiting:
            return []
        for thread in waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return [t.name for t in waiting if t.is_alive()]
            thread.join(left)


def flush_open_files() -> int:
    """Flush every open, writable Python file object (what closing it at the interpreter's
    teardown would write); returns how many were flushed. ~0.06 s with torch loaded."""
    flushed = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), _WRITABLE_FILES):
            continue
        with contextlib.suppress(Exception):   # closed, detached, a broken pipe: nothing to do
            if not obj.closed:
                obj.flush()
                flushed += 1
    return flushed


def end_process(code: int, *, thread_grace_s: float | None = None,
                flush_files: bool = False) -> NoReturn:
    """End this process with `code` as a normal exit would (see the module docstring), then
    `os._exit`. `thread_grace_s` bounds the wait for non-daemon threads (a script's thread
    that never ends must not hang its job: the job says which it left); `flush_files` for a
    process that ran a user's code."""
    from disttrain.resilience.watchdog import exit_now

    try:
        left = join_threads(thread_grace_s)
        if left:
            print(f"warning: thread(s) {', '.join(left)} still running {thread_grace_s:g} s "
                  "after the script ended; leaving without them", file=sys.stderr, flush=True)
        atexit._run_exitfuncs()
        if flush_files:
            flush_open_files()
    except KeyboardInterrupt:   # Ctrl-C while waiting for a thread: as interrupted
        code = 130
    finally:
        exit_now(code)
