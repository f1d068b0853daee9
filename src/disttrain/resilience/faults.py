"""Fault injection for the resilience tests: make one rank fail at an exact step, or slow.

    disttrain run --max-restarts 1 ...    # with envvars.FAULT set to kill:rank=1:step=17
    disttrain run ...                     # with envvars.FAULT set to slow-compute:rank=1:factor=3

TESTING ONLY. The variable `envvars.FAULT` (docs/resilience.md) set to
`ACTION:rank=R:step=S[:phase=P][:restart=N]` makes rank R
kill (SIGKILL), stop (SIGSTOP), hang (sleep forever, alive), exit (exit code 3) or raise
when its heartbeat (`disttrain.resilience.heartbeat`) reaches optimizer step S, in phase P if given
(forward, backward, optimizer, between steps, checkpoint, eval, finish), during restart
round N (default 0, so a restarted job runs clean). Several faults, comma-separated, each
for its own rank and round, put one job through a chain of failures and restarts
(`kill:rank=1:step=1,kill:rank=1:step=19:restart=1`): each round resumes from what the
earlier ones left. The variable is read here alone, once per process when the heartbeat
starts; unset, it costs one `is None` test per beat.

Three slowdowns make a straggler for the step-time breakdown's tests (`train/step_timing.py`,
docs/performance.md): `slow-compute:rank=R:factor=F` makes rank R's forward + backward
take F times as long (it busy-waits F-1 times its measured compute before each
micro-batch's forward, using the CPU as more work would), `slow-data:rank=R:ms=M` makes
each of rank R's batches arrive M ms later (its loader's next()), both from optimizer step
`step` (default 0) on; `cpu-share:rank=R` pins rank R to one CPU with two busy processes
(`CPU_SHARE_NICE`) beside it from its start (the same work on a share of a core: what other
tenants or a CPU limit do to a pod). The heartbeat never fires them: `Slowdown.install`
puts them at the step timer's seams (the telemetry owner, `train/telemetry.py`, calls it
once), and a run without a fault pays nothing per step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disttrain import envvars

if TYPE_CHECKING:
    from disttrain.train.step_timing import StepTimer

FAULT_ACTIONS = ("kill", "stop", "hang", "exit", "raise", "slow-compute", "slow-data", "cpu-share")
# slowdown -> the one option it needs ("": none)
SLOWDOWNS = {"slow-compute": "factor", "slow-data": "ms", "cpu-share": ""}
CPU_SHARE_SPINNERS = 2   # cpu-share: busy processes pinned to the rank's core beside it
# Their nice value where the process may raise its priority (root, CAP_SYS_NICE): each then
# weighs ~3x the rank in the scheduler, so the rank gets ~1/7 of its core whatever else runs
# on the machine (a test suite's other workers); elsewhere they run at the rank's priority.
CPU_SHARE_NICE = -5
# A cpu-share spinner: pinned to one CPU, it spins until its parent (the rank) is gone.
_SPIN = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nparent = int(sys.argv[2])\n"
         "try:\n    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[3]))\nexcept OSError:\n    pass\n"
         "while os.getppid() == parent:\n    for _ in range(20000):\n        pass\n")


@dataclass(frozen=True)
class Fault:
    """A failure to inject into one rank: see the module docstring (testing only)."""

    action: str
    rank: int
    step: int
    phase: str | None = None
    restart: int = 0
    factor: float = 1.0   # slow-compute: compute takes this many times as long
    ms: float = 0.0       # slow-data: each batch arrives this much later

    @property
    def slowdown(self) -> bool:
        """A slowdown (applied by the step timer), not a failure the heartbeat fires."""
        return self.action in SLOWDOWNS

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`kill:rank=1:step=17[:phase=backward][:restart=0]` -> Fault.

        Raises:
            ValueError: the text is malformed; the message shows the expected form.
        """
        usage = (f"{envvars.FAULT}={text!r}: expected ACTION:rank=R:step=S[:phase=P][:restart=N] "
                 f"with ACTION one of {', '.join(FAULT_ACTIONS)}, or slow-compute:rank=R:factor=F "
                 f"| slow-data:rank=R:ms=M [:step=S][:restart=N] | cpu-share:rank=R[:restart=N]")
        action, *parts = text.strip().split(":")
        values: dict[str, str] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in ("rank", "step", "phase", "restart", "factor", "ms"):
                raise ValueError(usage)
            values[key] = value
        if action == "cpu-share":
            wrong_keys = bool(values.keys() - {"rank", "restart"})
        elif action in SLOWDOWNS:
            slow = SLOWDOWNS[action]
            wrong_keys = slow not in values or bool(values.keys() - {"rank", "step", "restart", slow})
        else:
            wrong_keys = "step" not in values
        if action not in FAULT_ACTIONS or "rank" not in values or wrong_keys:
            raise ValueError(usage)
        try:
            fault = cls(action, int(values["rank"]), int(values.get("step", "0")),
                        values.get("phase") or None, int(values.get("restart", "0")),
                        float(values.get("factor", "1")), float(values.get("ms", "0")))
        except ValueError:
            raise ValueError(usage) from None
        if fault.factor < 1 or fault.ms < 0:
            raise ValueError(usage)
        return fault

    @classmethod
    def from_env(cls, rank: int, restart: int) -> Fault | None:
        """The fault `envvars.FAULT` gives this rank in this restart round, if any (the
        variable may list several, comma-separated; the first that matches is the one).

        Raises:
            ValueError: any listed fault is malformed (`parse`).
        """
        text = os.environ.get(envvars.FAULT, "")
        faults = [cls.parse(part) for part in text.split(",") if part.strip()]
        return next((f for f in faults if f.rank == rank and f.restart == restart), None)

    def fire(self, where: str, flush: Callable[[], None] | None = None) -> None:
        """Do the injected failure now, in this process.

        `stop` first publishes the heartbeat (`flush`), as a rank that had been stuck
        in one place for a while would have; a process frozen within one publishing
        interval of its last move is reported where it was last seen.
        """
        if self.slowdown:  # applied at the step timer's seams (`Slowdown`)
            return
        print(f"disttrain fault injection (testing only): {self.action} rank {self.rank} "
              f"pid {os.getpid()} at {where} t={time.time():.3f}", file=sys.stderr, flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            if flush is not None:
                flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "hang":
            while True:
                time.sleep(3600)
        elif self.action == "exit":
            os._exit(3)
        else:
            raise RuntimeError(f"disttrain fault injection: rank {self.rank} at {where}")


def busy_wait(seconds: float) -> None:
    """Work on the CPU until this thread has used `seconds` of CPU time (slow-compute's
    extra work: measured in CPU time, so that it stays work, not a wait for a core, when
    other processes share the cores and the wall time it takes grows)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class Slowdown:
    """A slow-compute or slow-data fault at the step timer's seams (testing only).

    slow-compute busy-waits in `StepTimer.delay_compute`, after the timer marked the start
    of compute, so the wait counts as compute: F-1 times the previous micro-batch's compute
    without its own wait. It spins rather than sleeps because a rank with more work (or a
    slower core) spends CPU time on it, and the verdict tells a rank that computes longer
    from one that waited for a core by that CPU time (`train/straggler.py`, "cpu share").
    slow-data wraps the epoch's batches, inside the timer's data phase. Both act from
    optimizer step `fault.step` on (`timer.steps`).
    """

    def __init__(self, fault: Fault, timer: StepTimer) -> None:
        self.fault, self.timer = fault, timer
        self.clock = time.perf_counter
        self._waited = 0.0   # the wall time the last busy-wait took

    @classmethod
    def install(cls, timer: StepTimer, rank: int) -> Slowdown | None:
        """The slowdown `envvars.FAULT` asks of this rank in this restart round, set into
        `timer`; None (nothing installed) otherwise, the rule outside the tests."""
        if not envvars.flag(envvars.FAULT):
            return None
        fault = Fault.from_env(rank, envvars.restart_count())
        if fault is None or not fault.slowdown:
            return None
        slow = cls(fault, timer)
        if fault.action == "slow-compute":
            timer.delay_compute = slow.delay_compute
        elif fault.action == "cpu-share":
            slow.share_core()
        return slow

    def share_core(self) -> None:
        """cpu-share: pin this rank's threads to one CPU and start `CPU_SHARE_SPINNERS` busy
        processes pinned to it, so the rank does its usual work and waits for that core (what
        other tenants or a CPU limit do to a pod); the spinners end when the rank does."""
        import subprocess

        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            print("disttrain fault injection (testing only): cpu-share needs 2 CPUs; "
                  "not injected", file=sys.stderr, flush=True)
            return
        core = cpus[-1]
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except OSError:   # a thread that ended meanwhile
                continue
        for _ in range(CPU_SHARE_SPINNERS):
            subprocess.Popen([sys.executable, "-c", _SPIN, str(core), str(os.getpid()),
                              str(CPU_SHARE_NICE)],
                             stdin=subprocess.DEVNULL, close_fds=True)
        print(f"disttrain fault injection (testing only): cpu-share rank {self.fault.rank} "
              f"pid {os.getpid()}: on CPU {core} with {CPU_SHARE_SPINNERS} busy processes",
              file=sys.stderr, flush=True)

    def delay_compute(self, last_compute_s: float) -> None:
        pure = max(last_compute_s - self._waited, 0.0)   # the last micro-batch without the wait
        work = (self.fault.factor - 1.0) * pure if self.timer.steps >= self.fault.step else 0.0
        start = self.clock()
        if work:
            busy_wait(work)
        self._waited = self.clock() - start

    def batches(self, batches: Iterable[Any]) -> Iterable[Any]:
        """`batches`, each arriving `fault.ms` later under slow-data (as they are otherwise)."""
        if self.fault.action != "slow-data":
            return batches
        return self._late(batches)

    def _late(self, batches: Iterable[Any]) -> Iterator[Any]:
        delay = self.fault.ms / 1000
        for item in batches:
            if self.timer.steps >= self.fault.step:
                time.sleep(delay)
            yield item
