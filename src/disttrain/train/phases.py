"""The step-time phases: the one list of columns every writer and reader of them uses.

    StepTimes(step_ms=12.0, data_ms=1.0, compute_ms=8.0, ...).as_dict()
    PHASES        # data, compute, comm wait, optimizer, other: they add up to step_ms
    STEP_KEYS     # ("step_ms", *PHASES, "compute_cpu_ms"): metrics.jsonl's train rows,
                  # live/rank-<R>.json, summary.json's `ranks`, TensorBoard's step_ms/<key>/rank<R>

The step timer (`train/step_timing.py`) fills them, the telemetry owner
(`train/telemetry.py`) writes them, the straggler verdict (`train/straggler.py`) judges
them, and `disttrain top`, `disttrain report` and the TensorBoard writer (`monitor/`) show
them, all from this module, so a phase added here reaches every one of them (the meaning
of each: docs/performance.md). Pure Python, no torch: the readers import it without
paying torch's import.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

__all__ = ["PHASES", "PHASE_NAMES", "STEP_KEYS", "StepTimes"]


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One rank's mean milliseconds per optimizer step over an interval (or the run)."""

    step_ms: float = 0.0        # the whole step: the sum of the phases below
    data_ms: float = 0.0        # waiting for the loader, and the batch's copy to the device
    compute_ms: float = 0.0     # forward + backward until the last gradient bucket is ready
    comm_wait_ms: float = 0.0   # the rest of backward: the wait for the all-reduce
    optimizer_ms: float = 0.0   # step, zero_grad, the LR scheduler
    other_ms: float = 0.0       # the loop around them: logging, checkpoints
    # Not a phase: the CPU time the training thread itself spent in compute_ms (CPU devices
    # only; 0 where not measured: CUDA, scripts). compute_ms well above it means the thread
    # waited for a core (other processes on its cores, a CPU limit's throttling), which the
    # straggler verdict tells apart from more work (`train/straggler.py`, "cpu share").
    compute_cpu_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(zip(STEP_KEYS, astuple(self)))


# Every column, in the order of StepTimes' fields.
STEP_KEYS: tuple[str, ...] = tuple(f.name for f in fields(StepTimes))
# The phases, in the order the bars stack (data + compute + comm + optimizer + other).
PHASES: tuple[str, ...] = ("data_ms", "compute_ms", "comm_wait_ms", "optimizer_ms", "other_ms")
PHASE_NAMES = {"data_ms": "data", "compute_ms": "compute", "comm_wait_ms": "comm wait",
               "optimizer_ms": "optimizer", "other_ms": "other"}
assert tuple(PHASE_NAMES) == PHASES, "every phase needs its display name"
assert STEP_KEYS[: len(PHASES) + 1] == ("step_ms", *PHASES), "StepTimes: the step, then its phases"
