"""Graceful stop on SIGTERM / SIGINT: every rank stops at the same optimizer step, one
checkpoint is written, and the job exits `errors.EXIT_STOPPED` (75: "stopped, resume me").

    stop = GracefulStop()
    stop.arm(rt)                        # in the rank's main thread, once (the Trainer does it)
    for step in ...:
        optimizer_step()
        if stop.agreed(step):           # a local test; a tiny all_reduce ~4 times a second
            save(); break

Why it works this way (docs/resilience.md, "Graceful stop"):

- The signal reaches every rank through torchrun's elastic agent: on SIGTERM / SIGINT it
  sends the same signal to each worker and waits `shutdown_timeout` (disttrain: the spec's
  `launch.stop_grace_s`) before SIGKILL. A Ctrl-C in a terminal may also reach a worker
  directly (when it shares the terminal's process group; a rank that leads its own session,
  `distributed.process.own_session`, does not), so a worker can see the same signal twice
  within milliseconds; a repeat within `DEBOUNCE_S` counts as the same request.
- The first signal only sets a flag. The ranks agree at an optimizer-step boundary, since
  a rank that stopped alone would leave the others in DDP's next all-reduce and a
  checkpoint would mix steps. To agree without a collective per step, the ranks run one
  all_reduce (MAX) of two numbers, the signal seen and the slowest rank's seconds per step,
  at steps they all compute alike: the next check comes after as many steps as fill about
  `CHECK_EVERY_S` at the slowest rank's pace (1 to `MAX_CHECK_STEPS`). The stop therefore
  starts within about max(CHECK_EVERY_S, one step) of the signal.
- Under CPU contention a collective is a rendezvous of ranks that each wait for a CPU: on the
  shared 2-vCPU VM a check took ~40 ms instead of ~0.7 ms, and at 4 checks a second the
  checks were ~20 % of the run (issue 21: the Trainer slower than a plain DDP loop, which
  has no such check). So the checks are also kept to `CHECK_BUDGET` of the time: the same
  all_reduce carries the last check's cost (the shortest over the ranks, the collective's
  own), and a check that cost more spaces the next ones out, up to `MAX_CHECK_S` apart.
- A second signal (after `DEBOUNCE_S`) stops the rank at once: the default action of that
  signal, so the process ends killed by it (exit status 128 + signum to a shell, -signum to
  torchrun), without a checkpoint; the previous one stays intact (atomic writes).

`STOP_FILE` (`RUN_DIR/stop.json`) is rank 0's record of a clean stop (signal, step, epoch,
checkpoint): `disttrain run` reads it to say what happened, since torch's agent, once
signalled, returns no values from the workers. What it finds is a typed `errors.Failure`
(`stop_failure`: STOPPED, INTERRUPTED, STOPPED_AFTER_END), whose kind gives the exit status
(`errors.OUTCOMES`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.errors import Failure, FailureKind
from disttrain.rundir import STOP_JSON

STOP_FILE = STOP_JSON
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEBOUNCE_S = 1.0        # a repeat of the signal within this is the same request (Ctrl-C + agent)
CHECK_EVERY_S = 0.25    # the ranks compare stop flags about this often (~0.7 ms each on gloo)
MAX_CHECK_STEPS = 100   # ... and at least every this many optimizer steps
CHECK_BUDGET = 0.01     # ... unless the checks would take more than this share of the time
MAX_CHECK_S = 5.0       # ... and then at most this far apart (well within the stop grace period)
LINGER_S = 1.0          # a stopped forked worker's wait for its agent (exit_after_return)


def signal_name(signum: int) -> str:
    """`SIGTERM` for 15; `signal 99` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class GracefulStop:
    """This rank's stop request and the ranks' agreement on when to act on it."""

    signum: int = 0             # the first stop signal this rank got (0: none)
    agreed_signum: int = 0      # the signal the ranks agreed to stop for (0: not stopping)
    _t_signal: float = 0.0
    _collective: bool = False
    _device: Any = None
    _next_check: int = 1
    _last_check: tuple[int | None, float] = (None, 0.0)   # (step, time) of the last check
    _check_s: float = 0.0       # how long this rank's last check took (compared at the next)
    _previous: dict[int, Any] | None = None

    def arm(self, rt: Any) -> None:
        """Catch SIGTERM / SIGINT from now on (main thread only: Python runs signal
        handlers there; elsewhere the request can still come from another rank).

        Args:
            rt: the rank's `disttrain.distributed.runtime.Runtime` (distributed, world
                size, device); taken as a value so this module needs nothing from there.
        """
        self._collective = bool(rt.distributed and rt.world_size > 1)
        self._device = rt.device
        self._last_check = (None, time.perf_counter())
        if threading.current_thread() is not threading.main_thread() or self._previous is not None:
            return
        self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}

    def disarm(self) -> None:
        """Give the signals back their previous handlers."""
        if self._previous is None:
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        global _received
        now = time.monotonic()
        _received = _received or signum
        if not self.signum:
            self.signum, self._t_signal = signum, now
            _say(f"got {signal_name(signum)}: stopping at the next optimizer step the ranks "
                 f"agree on, with a checkpoint (a second signal stops at once)")
        elif now - self._t_signal >= DEBOUNCE_S:
            _say(f"got {signal_name(signum)} again: stopping now, without a checkpoint")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def agreed(self, step: int) -> bool:
        """Whether the ranks stop after optimizer step `step`; call it after every step,
        on every rank, with the same `step`. A collective only at check steps."""
        if self.agreed_signum:
            return True
        if not self._collective:
            self.agreed_signum = self.signum
            return bool(self.signum)
        if step < self._next_check:
            return False
        import torch
        import torch.distributed as dist

        last_step, last_t = self._last_check
        now = time.perf_counter()
        # the first check (the run may have resumed at any step): all the time so far as one step
        per_step = (now - last_t) / max(step - (step - 1 if last_step is None else last_step), 1)
        # MAX of -cost is the MIN cost: the rank that came last waited only for the collective
        flags = torch.tensor([float(self.signum), per_step, -self._check_s], dtype=torch.float64,
                             device=self._device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, slowest, neg_cost = flags.tolist()
        self._check_s = time.perf_counter() - now
        self._last_check = (step, now)
        self._next_check = step + check_interval(slowest, -neg_cost)
        self.agreed_signum = int(signum)
        return bool(self.agreed_signum)


def check_interval(step_s: float, check_s: float) -> int:
    """Optimizer steps to the next stop check, the same on every rank (both arguments are
    reduced over the ranks): about `CHECK_EVERY_S` at the slowest rank's `step_s`, longer
    when a check's cost `check_s` would be more than `CHECK_BUDGET` of that time (up to
    `MAX_CHECK_S`), and 1 to `MAX_CHECK_STEPS` steps."""
    every = min(MAX_CHECK_S, max(CHECK_EVERY_S, check_s / CHECK_BUDGET))
    return max(1, min(MAX_CHECK_STEPS, int(every / max(step_s, 1e-9))))


_received = 0   # the first stop signal this process caught, whether or not the ranks acted on it


def received() -> int:
    """The first stop signal this process caught (0: none). A signal that came after the
    last step (during the final evaluation or the summary) stops nothing, but its agent is
    closing all the same: the worker must not wait for it (`exit_after_return`)."""
    return _received


def _say(text: str) -> None:
    """One line on stderr from a signal handler: os.write, which cannot re-enter a print
    the handler interrupted."""
    rank = os.environ.get(envvars.RANK, "?")
    os.write(2, f"disttrain rank {rank}: {text}\n".encode())


def exit_after_return(code: int, after_s: float = LINGER_S) -> None:
    """In a worker forked by torch's agent (a multiprocessing child), end the process with
    `code` `after_s` seconds from now unless it has ended by then.

    Why: such a worker, once its function returned, waits until the agent has read the
    return value; an agent that got the stop signal itself is closing instead and never
    reads it, so the worker would sit there until the SIGKILL at the end of the grace. An
    agent that was not signalled (the ranks were, directly) reads it at once and the
    process ends normally first. Nothing happens in a process that is not a child (plain
    torchrun's `python -m disttrain.worker`, the `env` launcher's own process).
    """
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return

    def later() -> None:
        time.sleep(after_s)
        from disttrain.resilience.watchdog import exit_now

        exit_now(code)

    threading.Thread(target=later, name="disttrain-stop-exit", daemon=True).start()


# -- the record of a clean stop ---------------------------------------------------------------
def write_stop_record(run_dir: Path, signum: int, step: int, epoch: int, checkpoint: Path) -> None:
    """Rank 0, after the checkpoint and summary: what `disttrain run` reports (atomic)."""
    data = {"signal": signal_name(signum), "signum": signum, "step": step, "epoch": epoch,
            "checkpoint": str(checkpoint)}
    tmp = run_dir / f".{STOP_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, run_dir / STOP_FILE)


def read_stop_record(run_dir: Path) -> dict[str, Any] | None:
    """The record of a clean stop in `run_dir`, or None (none, or unreadable)."""
    try:
        data = json.loads((run_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def clear_stop_record(run_dir: Path) -> None:
    """Remove an earlier run's record before a new launch, so it is never mistaken for
    this one's."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)


# -- what the launcher says --------------------------------------------------------------------
def stop_failure(run_dir: Path, signum: int, script: bool, resume_cmd: str,
                 since: float | None = None) -> Failure | None:
    """How a stopped job ended, typed where it is found (`errors.Failure`: its kind's
    `errors.OUTCOMES` row gives `disttrain run`'s exit status); None when it was not stopped.

    Args:
        run_dir: the job's run directory (rank 0's `STOP_FILE` there: a clean stop).
        signum: the signal the launcher got (0: none; the ranks may still have been
            signalled directly and stopped cleanly).
        script: a user script (its ranks got the signal; what they did is theirs).
        resume_cmd: the command that resumes this job.
        since: when this launch began (unix time): a summary.json written after it, with
            no stop in it, means the signal came once training was over.

    Returns:
        A clean stop: STOPPED (`errors.EXIT_STOPPED`); the signal after the last step:
        STOPPED_AFTER_END (exit 0); otherwise INTERRUPTED (the launcher's 128 + signum, as
        a shell reports a process killed by that signal).
    """
    record = read_stop_record(run_dir)
    if record is not None:
        return Failure(FailureKind.STOPPED,
                       f"stopped by {record.get('signal')} at step {record.get('step')}, epoch "
                       f"{record.get('epoch')}; checkpoint at {record.get('checkpoint')}; "
                       f"resume with: {resume_cmd}", rank=0)
    if not signum:
        return None
    name, code = signal_name(signum), 128 + signum
    if script:
        return Failure(FailureKind.INTERRUPTED,
                       f"stopped by {name}; the ranks got {name}, exit status {code}")
    if since is not None and _finished_since(run_dir, since):
        return Failure(FailureKind.STOPPED_AFTER_END, f"got {name} after the last step: the "
                       f"run had finished ({run_dir / 'summary.json'})")
    last = run_dir / "checkpoints" / "last.pt"
    after = (f"; the last checkpoint ({last}) resumes with: {resume_cmd}" if last.exists()
             else "")
    return Failure(FailureKind.INTERRUPTED,
                   f"stopped by {name} before the ranks could stop at a step and save (no "
                   f"checkpoint of this stop){after}; exit status {code}")


def _finished_since(run_dir: Path, since: float) -> bool:
    """Whether rank 0 wrote a complete run's summary.json (no stop in it) after `since`."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and not data.get("stopped")
