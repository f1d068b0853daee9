"""Where each optimizer step's time goes on this rank, always on and cheap (docs/performance.md).

    timer = StepTimer(); timer.attach(rt, comm)     # the Trainer does this in fit()
    timer.start()                                   # each epoch, before its first batch
    for batch in timer.timed(loader):               # data: the loader's next()
        timer.compute_start(); forward(); backward(); timer.compute_end()
        timer.optimizer_start(); step(); timer.optimizer_end()
    timer.interval()    # the means per step since the last call, ms: step, data, compute, ...

Why these phases: under DDP the job runs at the speed of its slowest rank, and only the
split of each rank's step tells which rank that is and why (`train/straggler.py`). The
five phases add up to the step: data (waiting for the loader, and the batch's copy to the
device), compute (forward + backward), comm_wait (the end of backward minus the moment the
step's last gradient bucket was handed to the DDP comm hook: DDP overlaps the all-reduce
with backward, so what is left after the last bucket is the wait for the other ranks and
the transfer; 0 without DDP, and FSDP's reduce-scatter counts as compute), optimizer
(step, zero_grad, LR scheduler) and other (the rest: logging, checkpoints, the loop).

Cost: on CPU a handful of `time.perf_counter()` calls and additions per step, summed
locally; nothing is communicated or synchronised per step. The Trainer carries the
interval means in the tensor it already all-gathers at its record flushes. On CUDA the
host clock would time kernel launches, not kernels: compute, comm_wait and optimizer are
then CUDA events recorded at the same boundaries (from a pool, reused) and read once per
logging interval, with one event synchronize; data and the step stay on the host clock
(the host waits for the loader; over an interval that ends in a synchronize, host and
device time per step agree).

`LiveStatus` writes each rank's latest figures to `RUN_DIR/live/rank-<R>.json` at every
logging interval (no collective), and rank 0's straggler verdict to `live/straggler.json`,
for `disttrain top`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from disttrain import envvars
from disttrain.rundir import LIVE
from disttrain.train.straggler import find_straggler

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from disttrain.distributed.comm_hooks import CommStats
    from disttrain.distributed.runtime import Runtime
    from disttrain.resilience.faults import Fault

__all__ = ["KEYS", "LiveStatus", "StepTimer", "StragglerWatch", "rank_identity"]

# The columns of metrics.jsonl's train rows, live/rank-<R>.json and summary.json's `ranks`.
KEYS = ("step_ms", "data_ms", "compute_ms", "comm_wait_ms", "optimizer_ms", "other_ms")
_DATA, _COMPUTE, _COMM, _OPT = range(4)
WINDOWS = 3   # the live verdict: the same rank, for the same cause, in this many consecutive intervals


class StepTimer:
    """Running sums of this rank's step phases: per logging interval and for the whole run."""

    def __init__(self) -> None:
        self._now = time.perf_counter
        self._t_next = self._t_step = self._t_opt = self._c0 = self._c_pure = 0.0
        self._ready: float | None = None
        self._step = [0.0, 0.0, 0.0, 0.0]          # data, compute, comm_wait, optimizer of this step
        self._sums = [0.0] * len(KEYS)              # this interval, seconds
        self._n = 0
        self._run = [0.0] * len(KEYS)               # the run, from the second interval on
        self._run_n = 0
        self._first: tuple[list[float], int] | None = None   # the first interval's sums, steps
        self.steps = 0                              # optimizer steps this process timed
        self._cuda: _CudaPhases | None = None
        self._slow: Fault | None = None             # a test-only slowdown (resilience/faults.py)
        self._pure = 0.0                            # the last micro-batch's compute without it

    def attach(self, rt: Runtime, comm: CommStats | None) -> None:
        """Time with CUDA events on a GPU, split backward at the DDP hook's last bucket, and
        apply a slowdown that `envvars.FAULT` injects into this rank (testing only)."""
        if comm is not None:
            comm.on_last_bucket = self.bucket_ready
        if rt.device.type == "cuda" and torch.cuda.is_available():
            self._cuda = _CudaPhases()
        if envvars.flag(envvars.FAULT):
            from disttrain.resilience.faults import Fault

            fault = Fault.from_env()
            if (fault is not None and fault.slowdown and fault.rank == rt.rank
                    and fault.restart == envvars.restart_count()):
                self._slow = fault

    # -- the boundaries (the Trainer's loop calls these) ------------------------------
    def start(self) -> None:
        """A step begins now: at an epoch's first batch (what ran before is not a step's)."""
        self._t_step = self._now()

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, noting when each was asked for: the data phase starts there."""
        it = iter(batches)
        slow = self._slow.ms / 1000 if self._slow is not None and self._slow.action == "slow-data" else 0.0
        while True:
            self._t_next = self._now()
            try:
                item = next(it)
            except StopIteration:
                return
            if slow and self.steps >= self._slow.step:  # type: ignore[union-attr]
                time.sleep(slow)
            yield item

    def compute_start(self) -> None:
        """The batch is on the device: data ends, forward begins."""
        t = self._now()
        self._step[_DATA] += t - self._t_next
        self._c0, self._ready = t, None
        if self._cuda is not None:
            self._cuda.mark("c0")
        if self._slow is not None and self._slow.action == "slow-compute" and self.steps >= self._slow.step:
            time.sleep((self._slow.factor - 1.0) * self._pure)
        self._c_pure = self._now() if self._slow is not None else t

    def bucket_ready(self) -> None:
        """The DDP comm hook got the step's last bucket: compute is done, the wait begins."""
        self._ready = self._now()
        if self._cuda is not None:
            self._cuda.mark("ready")

    def compute_end(self) -> None:
        """Backward returned (under DDP: its all-reduces are done)."""
        t = self._now()
        ready = t if self._ready is None else self._ready
        self._step[_COMPUTE] += ready - self._c0
        self._step[_COMM] += t - ready
        self._pure = ready - self._c_pure
        if self._cuda is not None:
            self._cuda.mark("end")

    def optimizer_start(self) -> None:
        self._t_opt = self._now()
        if self._cuda is not None:
            self._cuda.mark("o0")

    def optimizer_end(self) -> None:
        """The optimizer step is done: the step closes; what follows is the next one's."""
        t = self._now()
        if self._cuda is not None:
            self._cuda.mark("o1")
        s = self._step
        s[_OPT] += t - self._t_opt
        total = t - self._t_step
        sums = self._sums
        sums[0] += total
        sums[1] += s[_DATA]
        sums[2] += s[_COMPUTE]
        sums[3] += s[_COMM]
        sums[4] += s[_OPT]
        self._n += 1
        self.steps += 1
        s[0] = s[1] = s[2] = s[3] = 0.0
        self._t_step = t

    # -- reading (once per logging interval) --------------------------------------------
    def interval(self) -> tuple[float, ...]:
        """The means per step since the last call, in ms, in `KEYS` order; starts the next."""
        n, sums = self._n, self._sums
        if self._cuda is not None:
            sums[2], sums[3], sums[4] = self._cuda.read()
        if not n:
            return (0.0,) * len(KEYS)
        other = sums[0] - sums[1] - sums[2] - sums[3] - sums[4]
        sums[0] -= min(other, 0.0)   # device time over host time (CUDA): the step is the parts' sum
        sums[5] = max(other, 0.0)
        # The first interval (allocations, lazy initialisation) stays out of the run's
        # means once a later one exists.
        if self._first is None:
            self._first = (list(sums), n)
        else:
            for i, v in enumerate(sums):
                self._run[i] += v
            self._run_n += n
        means = tuple(round(1000 * v / n, 3) for v in sums)
        self._sums = [0.0] * len(KEYS)
        self._n = 0
        return means

    def run_means(self) -> dict[str, float]:
        """The whole run's means per step, ms (without the first interval when more ran)."""
        if self._n:
            self.interval()
        run, n = self._run, self._run_n
        if not n and self._first is not None:
            run, n = self._first
        return {k: round(1000 * v / max(n, 1), 3) for k, v in zip(KEYS, run)}


class _CudaPhases:
    """CUDA events at the phase boundaries of an interval's steps, read all at once."""

    def __init__(self) -> None:
        self._pool: list[torch.cuda.Event] = []
        self._marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(self, kind: str) -> None:
        i = len(self._marks)
        if i == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        ev = self._pool[i]
        ev.record()
        self._marks.append((kind, ev))

    def read(self) -> tuple[float, float, float]:
        """(compute, comm_wait, optimizer) seconds of the marked steps; one synchronize."""
        marks, self._marks = self._marks, []
        if not marks:
            return 0.0, 0.0, 0.0
        marks[-1][1].synchronize()
        compute = comm = opt = 0.0
        c0 = ready = o0 = None
        for kind, ev in marks:
            if kind == "c0":
                c0, ready = ev, None
            elif kind == "ready":
                ready = ev
            elif kind == "end" and c0 is not None:
                compute += c0.elapsed_time(ready or ev)
                comm += ready.elapsed_time(ev) if ready is not None else 0.0
            elif kind == "o0":
                o0 = ev
            elif kind == "o1" and o0 is not None:
                opt += o0.elapsed_time(ev)
        return compute / 1000, comm / 1000, opt / 1000


def rank_identity(rt: Runtime) -> dict[str, Any]:
    """This rank's rank, host and device, and the HAMi limit it runs under when the
    container shows one (`CUDA_DEVICE_SM_LIMIT`, `CUDA_DEVICE_MEMORY_LIMIT`: docs/cluster.md)."""
    from disttrain.diagnose.system import hami_limits

    limits = hami_limits(os.environ)
    parts = []
    if limits["sm_limit_percent"] is not None:
        parts.append(f"{envvars.CUDA_DEVICE_SM_LIMIT}={limits['sm_limit_percent']}%")
    mem = limits["memory_limit_mib"].get(str(rt.device.index or 0)) or limits["default_memory_limit_mib"]
    if mem:
        parts.append(f"gpumem {mem} MiB")
    ident: dict[str, Any] = {"rank": rt.rank, "host": socket.gethostname(), "device": str(rt.device)}
    if parts:
        ident["limit"] = "HAMi " + ", ".join(parts)
    return ident


class LiveStatus:
    """`RUN_DIR/live/rank-<R>.json`: this rank's latest interval, replaced atomically.

    A view for `disttrain top`, never a reason to stop training: a run directory this rank
    cannot write (read-only, full) turns the live files off with one warning."""

    def __init__(self, rt: Runtime, run_dir: Path) -> None:
        self.rank, self.world_size = rt.rank, rt.world_size
        self.ident = rank_identity(rt)
        self.dir = Path(run_dir) / LIVE
        self.path = self.dir / f"rank-{rt.rank}.json"
        self._last: dict[str, Any] = {}
        self.enabled = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if rt.is_rank0:   # an earlier attempt's verdict, and ranks this job does not have
                stale = [self.dir / "straggler.json"]
                stale += [p for p in self.dir.glob("rank-*.json")
                          if not p.stem[5:].isdigit() or int(p.stem[5:]) >= rt.world_size]
                for path in stale:
                    path.unlink(missing_ok=True)
        except OSError as e:
            self._off(e)

    def write(self, epoch: int, step: int, loss: float, samples_per_s: float,
              timing: tuple[float, ...], done: bool = False) -> None:
        rec = {"rank": self.rank, "world_size": self.world_size, "host": self.ident["host"],
               "pid": os.getpid(), "device": self.ident["device"], "epoch": epoch, "step": step,
               "loss": loss, "samples_per_s": round(samples_per_s, 1), **dict(zip(KEYS, timing))}
        if "limit" in self.ident:
            rec["limit"] = self.ident["limit"]
        self._last = rec
        self._replace(self.path, {**rec, "time": round(time.time(), 3), "done": done})

    def done(self) -> None:
        """The last write of the run: the latest figures again, `done` true."""
        if self._last:
            self._replace(self.path, {**self._last, "time": round(time.time(), 3), "done": True})

    def write_straggler(self, verdict: dict[str, Any]) -> None:
        self._replace(self.dir / "straggler.json", verdict)

    def _replace(self, path: Path, obj: dict[str, Any]) -> None:
        if not self.enabled:
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(obj), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            self._off(e)

    def _off(self, error: OSError) -> None:
        self.enabled = False
        print(f"warning: rank {self.rank}: live status files off ({self.dir}: {error}); "
              f"training goes on", file=sys.stderr, flush=True)


class StragglerWatch:
    """Rank 0's live verdict: printed once, when the same rank is named for the same cause
    in `WINDOWS` consecutive logging intervals (one slow interval is noise: a checkpoint,
    a neighbour's burst), so a verdict needs a slowdown that lasts."""

    def __init__(self, threshold: float = 1.5) -> None:
        self.threshold = threshold
        self.verdict: dict[str, Any] | None = None
        self._streak: tuple[Any, Any, int] = (None, None, 0)

    def window(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """One interval's per-rank means; returns the verdict the first time it is made."""
        if self.verdict is not None:
            return None
        v = find_straggler(entries, self.threshold)
        if v is None:
            self._streak = (None, None, 0)
            return None
        rank, cause, n = self._streak
        n = n + 1 if (rank, cause) == (v["rank"], v["cause"]) else 1
        self._streak = (v["rank"], v["cause"], n)
        if n >= WINDOWS:
            self.verdict = v
            return v
        return None
