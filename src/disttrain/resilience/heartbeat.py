"""The rank side of stall detection: where this rank is, published to the job's store.

    # in a training loop (the built-in Trainer already does this)
    heartbeat.start(rt.rank, rt.timeout_s, rt.store_address, model, optimizer)  # once
    for batch in loader:
        heartbeat.beat(step)                  # a few attribute writes: no I/O, no collective

Why: every rank keeps in memory where it is (optimizer step and phase: forward,
backward, optimizer, checkpoint, eval) and a daemon thread publishes that to the job's
c10d store as `disttrain/hb/<rank>` every `interval_for(timeout_s)` seconds, so the hot
loop never touches the network. `disttrain.resilience.watchdog` reads these records and names the
rank that stopped making progress.

The heartbeat is also where the test-only fault hook fires (`disttrain.resilience.faults`,
`envvars.FAULT`, docs/resilience.md), so injected failures land at exact steps; that
module is imported only when the variable is set. `start` takes plain values (rank,
timeout, store address), not a Runtime, so this module needs nothing from the process
group's side and the process group's side needs nothing from it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from disttrain import envvars
from disttrain.launch.ports import listening

if TYPE_CHECKING:
    import torch

    from disttrain.resilience.faults import Fault

KEY_PREFIX = "disttrain/hb/"
# Order of phases within one optimizer step: the rank furthest behind is the one the
# others wait for. `step` is the value of `beat(step)`: optimizer steps completed.
# `data`: a script rank between its optimizer step and its next forward (script_heartbeat).
PHASE_ORDER = {"setup": 0, "resume": 1, "eval": 2, "checkpoint": 3, "data": 3.5, "forward": 4,
               "backward": 5, "optimizer": 6, "between steps": 7, "finish": 8}


def interval_for(timeout_s: float) -> float:
    """How often heartbeats are published and read: 1/20 of the timeout, 0.1 s to 2 s."""
    return min(2.0, max(0.1, timeout_s / 20))


# -- the heartbeat ---------------------------------------------------------
class Heartbeat:
    """Where this rank is, in memory; a daemon thread publishes it to the store.

    `beat` and the model/optimizer hooks only assign attributes (sub-microsecond), so
    the training loop pays no I/O; the thread's `store.set` (~15 µs) runs once per
    interval. `seq` counts progress marks; `alive` counts publications, so a reader can
    tell a frozen process (neither moves) from one stuck while alive (only `alive` does).
    `coll` counts the collectives this rank entered and `in_coll` names the one it waits
    in now (a user script's, `resilience.script_probes`; the Trainer leaves both unset):
    ranks issue collectives in one order, so the rank that entered fewer is the one the
    others wait for, and a rank waiting for one that progresses is not stuck.
    """

    def __init__(self, rank: int, restart: int = 0, fault: Fault | None = None) -> None:
        self.rank, self.restart = rank, restart
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.step, self.phase, self.seq, self.alive = 0, "setup", 0, 0
        self.coll, self.in_coll = 0, ""
        # called by the publishing thread before each publication; True counts as progress
        # (a script's main thread seen executing Python: `script_heartbeat`)
        self.probe: Callable[[], bool] | None = None
        armed = fault is not None and fault.rank == rank and fault.restart == restart
        self._fault = fault if armed else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._hooks: list[Any] = []

    def beat(self, step: int, phase: str = "forward") -> None:
        """Progress: `step` optimizer steps done, now in `phase` (default: starting a
        micro-batch's forward)."""
        self.step, self.phase = step, phase
        self.seq += 1
        if self._fault is not None:
            self._check_fault()

    def mark(self, phase: str) -> None:
        """Progress within the current step (called by the hooks)."""
        self.phase = phase
        self.seq += 1
        if self._fault is not None:
            self._check_fault()

    def _check_fault(self) -> None:
        f = self._fault
        if f is not None and self.step == f.step and f.phase in (None, self.phase):
            self._fault = None
            f.fire(f"step {self.step}, phase {self.phase}", self.flush)

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "host": self.host,
                "restart": self.restart, "step": self.step, "phase": self.phase,
                "seq": self.seq, "alive": self.alive, "coll": self.coll,
                "in_coll": self.in_coll, "t": round(time.time(), 3)}

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Phase marks from hooks: backward (the first gradient of a step), optimizer.

        `beat(step)` marks forward. Module forward hooks are not used: they move every
        call onto nn.Module's slow path (+16 µs per step measured here); a gradient hook
        on the parameter whose gradient comes first (normally the last one) and the
        optimizer's step hooks cost under a microsecond.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        if params and hasattr(params[-1], "register_post_accumulate_grad_hook"):
            with contextlib.suppress(RuntimeError):
                self._hooks.append(params[-1].register_post_accumulate_grad_hook(
                    lambda _: self.mark("backward")))
        if optimizer is not None:
            self._hooks += [
                optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer")),
                optimizer.register_step_post_hook(lambda *_: self.mark("between steps")),
            ]

    def publish(self, store: Any, interval: float) -> None:
        """Start the daemon thread that writes `record()` to `store` every `interval` s."""
        self._store = store

        def loop() -> None:
            while True:
                try:
                    if self.probe is not None and self.probe():
                        self.seq += 1
                    self.flush()
                except Exception:  # the store is gone: the job is ending
                    return
                if self._stop.wait(interval):
                    return

        self._thread = threading.Thread(target=loop, name="disttrain-heartbeat", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Publish the current record now (the thread does this every interval)."""
        if self._store is not None:
            self.alive += 1
            self._store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(self.record()))

    def stop(self) -> None:
        """Publish phase `done` (never judged: what the process does next is not
        training), stop publishing and remove the hooks (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._thread is not None and self.phase != "done":
            self.phase = "done"
            with contextlib.suppress(Exception):
                self.flush()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


_current: Heartbeat | None = None


def start(rank: int, timeout_s: float, store_address: tuple[str, int] | None = None,
          model: torch.nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None) -> Heartbeat:
    """Begin this rank's heartbeat (replacing an earlier one); publish when there is a store.

    Args:
        rank: this process's rank (`rt.rank`).
        timeout_s: the stall timeout (`rt.timeout_s`); sets the publishing interval.
        store_address: (host, port) of the job's c10d store (`rt.store_address`); None
            (a single process) keeps the record in memory only.
        model: a gradient hook on it marks the backward phase.
        optimizer: hooks on it mark the optimizer phase.

    Returns:
        The heartbeat; `beat(step)` updates it from anywhere in this process.
    """
    global _current
    stop()
    restart = envvars.restart_count()
    hb = Heartbeat(rank, restart, _fault_from_env(rank, restart))
    if model is not None:
        hb.attach(model, optimizer)
    if store_address is not None:
        store = store_client(*store_address, timeout_s)
        if store is not None:
            hb.publish(store, interval_for(timeout_s))
    _current = hb
    return hb


def _fault_from_env(rank: int, restart: int) -> Fault | None:
    """The test-only fault to inject, imported only when `envvars.FAULT` is set: a
    training run without it never loads the fault-injection module."""
    if not envvars.flag(envvars.FAULT):
        return None
    from disttrain.resilience.faults import Fault

    return Fault.from_env(rank, restart)


def current() -> Heartbeat | None:
    """This process's running heartbeat, if any (a user script's entry leaves one the
    Trainer started alone: `disttrain.resilience.script_heartbeat`)."""
    return _current


def beat(step: int, phase: str = "forward") -> None:
    """Mark progress of this rank's heartbeat; a no-op before `start`."""
    hb = _current
    if hb is not None:
        hb.beat(step, phase)


def stop() -> None:
    """Stop this process's heartbeat, if any."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A TCPStore client of the job's store, or None when it does not answer.

    A plain socket probe comes first: a TCPStore client that cannot connect retries
    and prints C++ stack traces, which must not land in the user's log.
    """
    if not listening(host, port):
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(5.0, min(timeout_s, 60.0))))
    except Exception:
        return None
