"""Wait, with the GIL released, until gloo's worker threads have let go of every finished
collective, so that none of them needs the GIL once the interpreter is ending.

    wait_for_gloo_idle()      # Runtime.shutdown, on gloo, after the last collective

Why (a core dump of this project's suite, torch 2.13): a user's script that trains through
`runtime.setup_from_args` finished, printed its result and ended; during `Py_FinalizeEx` a
`pt_gloo_runloop` thread was still destroying the barrier's work, which held the finished
all-gather's work, whose tensors Python had dropped: `~AsyncBarrierWork ->
~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire`. A thread that
asks for the GIL while the interpreter finalizes is ended with `pthread_exit`, whose forced
unwind through a noexcept destructor is `std::terminate`: "terminate called without an
active exception", SIGABRT, after a run that succeeded. A collective's `wait()` returns when
the work is done, not when the worker has freed it (`ProcessGroupGloo::runLoop`).

Idle is read from /proc: an idle `pt_gloo_runloop` thread waits, without a timeout, on its
queue's condition variable (a futex with no timeout argument); one that runs, or waits for
the GIL (a timed futex wait: CPython's `take_gil`), is not idle yet.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

RUNLOOP = "pt_gloo_runloop"   # the name torch gives gloo's worker threads
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
PROC_TASKS = Path("/proc/self/task")


def runloops_idle(tasks: Path = PROC_TASKS) -> bool | None:
    """True when every gloo worker thread of this process is idle (an untimed futex wait),
    False when one runs or waits with a timeout, None when /proc cannot tell."""
    if FUTEX is None:
        return None
    try:
        for task in tasks.iterdir():
            if (task / "comm").read_text().strip() != RUNLOOP:
                continue
            call = (task / "syscall").read_text().split()
            # "NR arg1 ... arg6 sp pc"; futex's 4th argument is its timeout; "running" or
            # "-1 ..." (in the kernel, not a syscall) is not idle
            if len(call) < 5 or call[0] != str(FUTEX) or int(call[4], 16) != 0:
                return False
    except (OSError, ValueError):   # a thread that ended meanwhile, or no /proc
        return None
    return True


def wait_for_gloo_idle(bound_s: float = 1.0, poll_s: float = 0.002) -> bool:
    """Sleep (the GIL released) until `runloops_idle`, at most `bound_s`; where /proc cannot
    tell, one short sleep. Returns whether the threads were seen idle."""
    deadline = time.monotonic() + bound_s
    while True:
        idle = runloops_idle()
        if idle is None:
            time.sleep(min(0.05, bound_s))
            return False
        if idle:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
