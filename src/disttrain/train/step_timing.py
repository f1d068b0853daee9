"""Where each optimizer step's time goes on this rank, always on and cheap (docs/performance.md).

    timer = StepTimer(); timer.attach(rt, comm)     # the Trainer does this in fit()
    timer.start()                                   # each epoch, before its first batch
    for batch in timer.timed(loader):               # data: the loader's next()
        timer.compute_start(); forward(); backward(); timer.compute_end()
        timer.optimizer_start(); step(); timer.optimizer_end()
    timer.interval()    # StepTimes: the means per step since the last call, ms (train/phases.py)

Why these phases: under DDP the job runs at the speed of its slowest rank, and only the
split of each rank's step tells which rank that is and why (`train/straggler.py`). The
five phases add up to the step: data (waiting for the loader, and the batch's copy to the
device), compute (forward + backward), comm_wait (the end of backward minus the moment the
step's last gradient bucket was handed to the DDP comm hook: DDP overlaps the all-reduce
with backward, so what is left after the last bucket is the wait for the other ranks and
the transfer; 0 without DDP, and FSDP's reduce-scatter counts as compute), optimizer
(step, zero_grad, LR scheduler) and other (the rest: logging, checkpoints, the loop).

On a CPU device the timer also reads the training thread's own CPU clock
(`time.thread_time()`) where compute starts and ends: `compute_cpu_ms`, the CPU time that
compute took. A rank whose compute takes longer in wall time than its CPU time says waited
for a core (other processes on its cores, or its pod's CPU limit throttling it), which the
straggler verdict names as "cpu share" rather than as more work (`train/straggler.py`).

Cost: on CPU a handful of `time.perf_counter()` calls, three `time.thread_time()` calls
(about a microsecond each here) and additions per step, summed locally; nothing is
communicated or synchronised per step. The Trainer carries the
interval means in the tensor it already all-gathers at its record flushes. On CUDA the
host clock would time kernel launches, not kernels: compute, comm_wait and optimizer are
then CUDA events recorded at the same boundaries (from a pool, reused) and read once per
logging interval, with one event synchronize; data and the step stay on the host clock
(the host waits for the loader; over an interval that ends in a synchronize, host and
device time per step agree).

The timer only measures: the live files, the records and the straggler verdict are the
telemetry owner's (`train/telemetry.py`), the phase list is `train/phases.py`'s, and a
test-only slowdown (`resilience/faults.py`) spins in the `delay_compute` seam.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from disttrain.train.phases import STEP_KEYS, StepTimes

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from disttrain.distributed.comm_hooks import CommStats
    from disttrain.distributed.runtime import Runtime

__all__ = ["StepTimer"]

_DATA, _COMPUTE, _COMM, _OPT, _CPU = range(5)
_N = len(STEP_KEYS)
_CPU_KEY = STEP_KEYS.index("compute_cpu_ms")


class StepTimer:
    """Running sums of this rank's step phases: per logging interval and for the whole run."""

    def __init__(self) -> None:
        self._now = time.perf_counter
        self._cpu_now: Callable[[], float] | None = time.thread_time   # None on CUDA
        self._t_next = self._t_step = self._t_opt = self._c0 = self._c0_cpu = 0.0
        self._ready: float | None = None
        self._ready_cpu = 0.0
        self._step = [0.0, 0.0, 0.0, 0.0, 0.0]     # data, compute, comm_wait, optimizer, compute CPU
        self._sums = [0.0] * _N                     # this interval, seconds, in STEP_KEYS order
        self._n = 0
        self._run = [0.0] * _N                      # the run, from the second interval on
        self._run_n = 0
        self._first: tuple[list[float], int] | None = None   # the first interval's sums, steps
        self.steps = 0                              # optimizer steps this process timed
        self.last_compute_s = 0.0                   # the last micro-batch's compute
        # Called at each compute_start with `last_compute_s` (None: nothing, the rule): the
        # seam where a test-only slowdown busy-waits (resilience/faults.py, `Slowdown`).
        self.delay_compute: Callable[[float], None] | None = None
        self._cuda: _CudaPhases | None = None

    def attach(self, rt: Runtime, comm: CommStats | None) -> None:
        """Time with CUDA events on a GPU, and split backward at the DDP hook's last bucket."""
        if comm is not None:
            comm.on_last_bucket = self.bucket_ready
        if rt.device.type == "cuda" and torch.cuda.is_available():
            self._cuda = _CudaPhases()
            self._cpu_now = None   # the host thread only launches kernels there

    # -- the boundaries (the Trainer's loop calls these) ------------------------------
    def start(self) -> None:
        """A step begins now: at an epoch's first batch (what ran before is not a step's)."""
        self._t_step = self._now()

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, noting when each was asked for: the data phase starts there."""
        it = iter(batches)
        while True:
            self._t_next = self._now()
            try:
                item = next(it)
            except StopIteration:
                return
            yield item

    def compute_start(self) -> None:
        """The batch is on the device: data ends, forward begins."""
        t = self._now()
        self._step[_DATA] += t - self._t_next
        self._c0, self._ready = t, None
        if self._cpu_now is not None:
            self._c0_cpu = self._cpu_now()
        if self._cuda is not None:
            self._cuda.mark("c0")
        if self.delay_compute is not None:
            self.delay_compute(self.last_compute_s)

    def bucket_ready(self) -> None:
        """The DDP comm hook got the step's last bucket: compute is done, the wait begins."""
        self._ready = self._now()
        if self._cpu_now is not None:   # backward of a CPU graph runs on the calling thread
            self._ready_cpu = self._cpu_now()
        if self._cuda is not None:
            self._cuda.mark("ready")

    def compute_end(self) -> None:
        """Backward returned (under DDP: its all-reduces are done)."""
        t = self._now()
        ready = t if self._ready is None else self._ready
        self.last_compute_s = ready - self._c0
        self._step[_COMPUTE] += self.last_compute_s
        self._step[_COMM] += t - ready
        if self._cpu_now is not None:
            end_cpu = self._cpu_now() if self._ready is None else self._ready_cpu
            self._step[_CPU] += end_cpu - self._c0_cpu
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
        sums[_CPU_KEY] += s[_CPU]
        self._n += 1
        self.steps += 1
        s[0] = s[1] = s[2] = s[3] = s[4] = 0.0
        self._t_step = t

    # -- reading (once per logging interval) --------------------------------------------
    def interval(self) -> StepTimes:
        """The means per step since the last call, in ms; starts the next interval."""
        n, sums = self._n, self._sums
        if self._cuda is not None:
            sums[2], sums[3], sums[4] = self._cuda.read()
        if not n:
            return StepTimes()
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
        means = StepTimes(*(round(1000 * v / n, 3) for v in sums))
        self._sums = [0.0] * _N
        self._n = 0
        return means

    @property
    def steady(self) -> bool:
        """Whether an interval after the first was timed: only then do the run's means leave
        out the first steps' allocations and lazy initialisation."""
        return self._run_n > 0

    def run_means(self) -> StepTimes:
        """The whole run's means per step, ms (without the first interval when more ran)."""
        if self._n:
            self.interval()
        run, n = self._run, self._run_n
        if not n and self._first is not None:
            run, n = self._first
        return StepTimes(*(round(1000 * v / max(n, 1), 3) for v in run))


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
