"""Stall detection: a stuck rank ends the job within `timeout_s`, by name.

    # in the launcher (disttrain.launch.launchers already does this)
    with Watchdog("127.0.0.1", port, world_size=2, timeout_s=30, on_stall=report):
        elastic_launch(config, entry)(...)

    # in rank 0 under plain torchrun (disttrain.worker.main already does this)
    with in_job_watchdog(master_addr, master_port, world_size=2, timeout_s=30):
        train()

Why: a rank that is SIGSTOPped, deadlocked, or stuck in a collective makes every other
rank wait for it, and torch's only guard is the collective timeout (30 minutes unless
set), whose error comes from a rank that was *waiting*, not from the stuck one (the NCCL
watchdog timeout users report, e.g. pytorch/pytorch#118369). So every rank keeps in
memory where it is (optimizer step and phase: forward, backward, optimizer, checkpoint,
eval) and publishes it to the job's c10d store (`disttrain.resilience.heartbeat`: a
daemon thread, the hot loop never touches the network). The launcher's `Watchdog` thread
reads those records and, when a rank has made no progress for `timeout_s`, reports
`rank 1 (pid …, host …) made no progress for 30 s; last seen: step 17, phase backward`
and SIGKILLs it; torchrun's agent then fails the job (or restarts it, --max-restarts).
Where no disttrain launcher runs (plain `torchrun -m disttrain.worker` in a pod), rank 0
runs the same `Watchdog` in a thread (`in_job_watchdog`) and, after the report, ends its
own process with `STALL_EXIT_CODE`, so torchrun's agent tears the job down at once.
`disttrain run` sets `envvars.WATCHDOG` (to `launcher`) for its workers to keep that off.

Which rank is to blame when all have stopped (the stuck one and those waiting on it): a
rank whose publisher thread stopped too is frozen (SIGSTOP, a GIL-holding hang) and is
chosen first; otherwise the rank furthest behind (lowest step, then earliest phase),
since the others are waiting in a collective for it. Collectives get a grace on top of
`timeout_s` (`collective_timeout_s`) so that this watchdog, which knows the rank and
phase, fires before a waiting rank's collective times out with a less useful error.
Why not torch's FileTimer, health checks or monitored_barrier: docs/resilience.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from disttrain import envvars
from disttrain.errors import FailureKind, HostLost, RankStalled
from disttrain.launch.ports import listening
from disttrain.resilience.heartbeat import KEY_PREFIX, PHASE_ORDER, interval_for, store_client

# What rank 0 exits with after reporting a stall: what `disttrain run` returns for one.
STALL_EXIT_CODE = 1


@dataclass(frozen=True)
class Stall:
    """A rank that made no progress for the timeout, and where it was."""

    rank: int
    pid: int
    host: str
    step: int
    phase: str
    stale_s: float
    frozen: bool
    waiting: tuple[tuple[int, int, str], ...] = ()   # (rank, step, phase) of the others
    tied: tuple[tuple[int, int], ...] = ()   # (rank, pid): alive, stuck at the same place
    local: bool = True

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.pid, *(pid for _, pid in self.tied))

    @property
    def kind(self) -> FailureKind:
        """LOST_HOST when nothing arrives from the rank's host (another host, its publisher
        silent too: a lost node or a partition), else STALL: decided here, where it is seen."""
        return FailureKind.LOST_HOST if self.frozen and not self.local else FailureKind.STALL

    def error(self) -> RankStalled:
        """The typed error of this stall (`HostLost` for a lost host), as a rank records it."""
        return (HostLost if self.kind is FailureKind.LOST_HOST else RankStalled)(self.message)

    @property
    def message(self) -> str:
        if self.tied:
            ranks = ", ".join(str(r) for r in (self.rank, *(r for r, _ in self.tied)))
            pids = ", ".join(str(p) for p in self.pids)
            return (f"ranks {ranks} (pids {pids}, host {self.host}) made no progress for "
                    f"{self.stale_s:.0f} s; last seen: all at step {self.step}, phase "
                    f"{self.phase}, alive: one of them is stuck there outside a collective "
                    f"(a deadlock, or waiting for something outside the job) and the others "
                    f"wait for it in one")
        text = (f"rank {self.rank} (pid {self.pid}, host {self.host}) made no progress for "
                f"{self.stale_s:.0f} s; last seen: step {self.step}, phase {self.phase}")
        if self.frozen and not self.local:
            # nothing arrives from that host any more: from here, a partition, a lost node
            # and a stopped process look the same (docs/resilience.md, "Hosts lost")
            text += (f"; nothing arrives from host {self.host}: it is unreachable (a network "
                     f"partition or a lost node), or the process is stopped")
        else:
            text += ("; the process is not running (stopped, or blocked holding the GIL)"
                     if self.frozen else "; the process is alive but stuck (a deadlock, or "
                                         "waiting for something outside the job)")
        if self.waiting:
            text += "; waiting for it: " + ", ".join(
                f"rank {r} (step {s}, {p})" for r, s, p in self.waiting[:4])
        return text


@dataclass
class _Seen:
    record: dict[str, Any]
    progress_at: float
    alive_at: float


@dataclass
class Watchdog:
    """Reads every rank's heartbeat from the job's store; acts on a stalled rank.

    Args:
        host, port: the job's c10d store (torchrun's agent store: MASTER_ADDR/PORT).
        world_size: ranks to watch.
        timeout_s: a rank without progress this long is stalled.
        on_stall: called with each `Stall` (e.g. to print it).
        kill: SIGKILL a stalled rank that runs on this host, so torchrun's agent sees a
            failed worker (a SIGSTOPped one would ignore the agent's SIGTERM for 30 s).
            Never this process itself: see `exit_code`.
        interval: poll period (default `interval_for(timeout_s)`).
        exit_code: after acting, end this process with it (`os._exit`). For a watchdog
            inside rank 0: its exit makes torchrun's agent stop the job at once, also
            when the stalled rank is on another host, or is rank 0 itself.
        ranks: judge only these ranks (default: all of `world_size`).
        frozen_only: act only on a rank whose whole process stopped (its publisher
            thread too), not on one that is alive but waiting: rank 1's backup watch of
            rank 0, whose own watchdog covers every other case.

    Staleness is measured on this process's monotonic clock from when a change was
    first seen, so clocks of other hosts do not matter.
    """

    host: str
    port: int
    world_size: int
    timeout_s: float
    on_stall: Callable[[Stall], None] | None = None
    kill: bool = True
    interval: float | None = None
    exit_code: int | None = None
    ranks: tuple[int, ...] | None = None
    frozen_only: bool = False
    stalls: list[Stall] = field(default_factory=list, init=False)
    _seen: dict[int, _Seen] = field(default_factory=dict, init=False)
    _killed: set[int] = field(default_factory=set, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.interval = self.interval or interval_for(self.timeout_s)
        self._hostname = socket.gethostname()

    @property
    def frozen_after(self) -> float:
        """A publisher silent this long means the whole process is not running."""
        assert self.interval is not None
        return 3 * self.interval + 1.0

    # -- pure logic (unit-tested without processes) ------------------------------------
    def observe(self, records: dict[int, dict[str, Any]], now: float) -> None:
        """Take in the latest records; note when each rank last moved."""
        for rank, rec in records.items():
            if rec.get("pid") in self._killed:
                continue
            old = self._seen.get(rank)
            if old is None or old.record.get("pid") != rec.get("pid"):
                self._seen[rank] = _Seen(rec, now, now)
                continue
            if rec.get("seq") != old.record.get("seq"):
                old.progress_at = now
            if rec.get("alive") != old.record.get("alive"):
                old.alive_at = now
            old.record = rec

    def judge(self, now: float) -> Stall | None:
        """The rank to blame when one has made no progress for `timeout_s`, else None."""
        rows = []
        for rank, seen in self._seen.items():
            if self.ranks is not None and rank not in self.ranks:
                continue
            if seen.record.get("phase") == "done" or not self._running(seen.record):
                continue  # finished training, or exited: torchrun's agent handles that
            frozen = now - seen.alive_at > self.frozen_after
            if self.frozen_only and not frozen:
                continue
            rows.append((rank, seen, now - seen.progress_at, frozen))
        # A rank waiting in a collective (a script's record names it: `in_coll`) is not
        # stuck while another rank still progresses: the rank it waits for is working
        # (rank 0 evaluating while the others wait at a barrier). Entering a collective is
        # progress too: it may be the one the waiting ranks need, and on a busy machine a
        # poll can land between rank 0's entry and the barrier's release (a clean-clone
        # suite named the waiting rank so). Once nobody progresses for `timeout_s`, the
        # waiting ones count again and the one behind is named.
        working = any(stale < self.timeout_s for _, seen, stale, _ in rows)
        if not any(stale >= self.timeout_s and (frozen or not working
                                                or not seen.record.get("in_coll"))
                   for _, seen, stale, frozen in rows):
            return None
        suspects = [r for r in rows if r[2] >= self.timeout_s / 2]

        def behind(row: tuple[int, _Seen, float, bool]) -> tuple[Any, ...]:
            # ranks enter collectives in one order: fewer entered (`coll`) is further behind
            rank, seen, stale, frozen = row
            rec = seen.record
            return (not frozen, int(rec.get("step", 0)), int(rec.get("coll") or 0),
                    PHASE_ORDER.get(rec.get("phase"), 4), -stale, rank)

        first = min(suspects, key=behind)
        rank, seen, stale, frozen = first
        # Alive ranks at the very same place: which one is outside the collective cannot
        # be told from here, so all are named (and stopped).
        tied = [] if frozen else [r for r in suspects if r is not first and not r[3]
                                  and behind(r)[1:4] == behind(first)[1:4]]
        rec = seen.record
        waiting = tuple((r, int(s.record.get("step", 0)), str(s.record.get("phase")))
                        for r, s, _, _ in sorted(suspects, key=lambda x: x[0])
                        if r != rank and all(r != t[0] for t in tied))
        return Stall(rank, int(rec.get("pid", 0)), str(rec.get("host", "?")),
                     int(rec.get("step", 0)), str(rec.get("phase", "?")), stale, frozen,
                     waiting, tuple((r, int(s.record.get("pid", 0))) for r, s, _, _ in tied),
                     local=rec.get("host") == self._hostname)

    def act(self, stall: Stall) -> None:
        """Record and report a stall, kill the rank when it is local, start afresh (or
        end this process, with `exit_code`)."""
        self.stalls.append(stall)
        if self.on_stall is not None:
            self.on_stall(stall)
        if self.kill and stall.local:
            for pid in stall.pids:
                if pid != os.getpid():  # rank 0 stalled itself: `exit_code` ends it
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self._killed.add(pid)
        self._seen.clear()  # the other ranks fail or restart; judge them anew
        if self.exit_code is not None:
            exit_now(self.exit_code)

    def _running(self, rec: dict[str, Any]) -> bool:
        if rec.get("host") != self._hostname:
            return True  # another node's process: it cannot be checked from here
        try:
            import psutil

            return psutil.Process(int(rec["pid"])).status() not in (
                psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except Exception:
            return False

    # -- the thread ----------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        store, found = None, set()
        assert self.interval is not None
        while not self._stop.wait(self.interval):
            if not listening(self.host, self.port):
                store = None  # no store (yet, or any more): nothing to read
                continue
            if store is None:
                store = store_client(self.host, self.port, self.timeout_s)
                if store is None:
                    continue
            try:
                records = self._read(store, found)
            except Exception:
                store = None
                continue
            now = time.monotonic()
            self.observe(records, now)
            stall = self.judge(now)
            if stall is not None:
                self.act(stall)

    def _read(self, store: Any, found: set[int]) -> dict[int, dict[str, Any]]:
        for rank in self.ranks if self.ranks is not None else range(self.world_size):
            if rank not in found and store.check([f"{KEY_PREFIX}{rank}"]):
                found.add(rank)
        ranks = sorted(found)
        if not ranks:
            return {}
        values = store.multi_get([f"{KEY_PREFIX}{r}" for r in ranks])
        out = {}
        for rank, raw in zip(ranks, values):
            with contextlib.suppress(ValueError, TypeError):
                out[rank] = json.loads(bytes(raw).decode())
        return out


def stall_line(stall: Stall, ends_job: bool = False, exiting_rank: int = 0) -> str:
    """The one-line report of a stall, as the launcher and rank 0 (or rank 1, watching
    rank 0) print it (and `disttrain doctor logs` reads it back)."""
    action = "; stopping it" if stall.local else ""
    if ends_job:
        action += f"; ending the job (rank {exiting_rank} exits with code {STALL_EXIT_CODE})"
    return f"error: {stall.message}{action}"


@contextlib.contextmanager
def unless_watched(env: Any, timeout_s: float) -> Iterator[None]:
    """`in_job_watchdog` on ranks 0 and 1 of a multi-rank job that no disttrain launcher
    watches (plain torchrun: a pod); nothing where `disttrain run` sets `envvars.WATCHDOG`,
    on other ranks, alone, or without a readable environment (`env` None).

    Args:
        env: the rank's `disttrain.distributed.env.DistEnv` (rank, world size, master).
        timeout_s: the stall timeout.
    """
    if envvars.flag(envvars.WATCHDOG) or env is None or env.rank > 1 or env.world_size < 2:
        yield
        return
    with in_job_watchdog(env.master_addr, env.master_port, env.world_size, timeout_s,
                         watcher_rank=env.rank):
        yield


def in_job_watchdog(host: str, port: int, world_size: int, timeout_s: float,
                    watcher_rank: int = 0) -> Watchdog:
    """The watchdog a rank runs when no disttrain launcher watches (plain torchrun).

    Rank 0 watches every rank. Rank 1 (`watcher_rank=1`) watches rank 0 alone and acts
    only when rank 0's whole process stopped (SIGSTOP, a C call holding the GIL), the
    one case where rank 0 cannot watch. Either reports a stall on stderr, kills the
    stalled rank when it is on this host, and then exits its own process with
    `STALL_EXIT_CODE`: torchrun's agent sees a failed worker and stops the job, instead
    of waiting for a collective to time out with an error from a rank that was only
    waiting. Use it as a context manager around training.
    """
    def report(stall: Stall) -> None:
        print(stall_line(stall, ends_job=True, exiting_rank=watcher_rank), file=sys.stderr,
              flush=True)
        _record_for_torchrun(stall.error())

    backup = watcher_rank != 0
    return Watchdog(host, port, world_size=1 if backup else world_size, timeout_s=timeout_s,
                    on_stall=report, exit_code=STALL_EXIT_CODE,
                    ranks=(0,) if backup else None, frozen_only=backup)



def _record_for_torchrun(exc: RankStalled) -> None:
    """Write the stall to torchrun's error file, so that its failure summary, which can
    only list rank 0 (the process that exits), carries the line naming the stalled rank."""
    if not os.environ.get(envvars.ERROR_FILE):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise exc  # torch's summary shows the recorded traceback: it needs one
        except RankStalled as raised:
            ErrorHandler().record_exception(raised)


def exit_now(code: int) -> None:
    """End this process after flushing stdout/stderr, without interpreter teardown: from
    the watchdog thread, because the main thread may sit in a collective that a normal
    exit (atexit handlers, thread joins) would wait for; at the end of a pod worker, see
    `disttrain.worker`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
