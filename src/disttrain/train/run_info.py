"""What a built run is: the settings the start banner prints and summary.json opens with.

    info = RunInfo(name="disttrain", workload="digits", strategy="ddp", ...)
    info.as_dict()      # the summary's first keys, in this order, JSON-ready

`build_trainer` fills it from the spec and what it resolved (the strategy that really
runs, the scaled LR, the optimizer it made); the Trainer adds `first_step_s` once the
first optimizer step is done, and the end-of-run results after these keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class RunInfo:
    """The resolved settings of one run; field order is summary.json's key order."""

    name: str
    workload: str                 # the task's name (TrainTask.name: digits, chargpt, yours)
    strategy: str                 # as asked (train.strategy)
    strategy_effective: str       # what runs: ddp/fsdp at world size 1 run as none
    backend: str
    device: str
    world_size: int
    batch_size: int               # per rank and micro-step
    grad_accum: int
    global_batch: int             # samples per optimizer step over all ranks
    lr_base: float
    lr_effective: float           # scaled with the global batch (train.lr_scaling)
    lr_scaling: str
    warmup_steps: int
    precision: str
    comm_hook: str                # "none" unless DDP or FSDP communicates gradients
    optimizer: str                # e.g. "Adam (fused)"
    torch_version: str
    train_samples: int
    test_samples: int
    data_preloaded: bool          # the data is the warm fork server's shared copy
    allreduce_bytes_per_step: int  # FSDP's computed; DDP's comm hook measures its own
    run_dir: Path
    notes: list[str] = field(default_factory=list)
    # launch -> end of the first optimizer step; only a run that takes step 1 has it
    # (a resumed one does not), and summary.json has the key only then.
    first_step_s: float | None = None
    first_step_measured: bool = field(default=False, repr=False)

    def record_first_step(self, seconds: float | None) -> None:
        self.first_step_s, self.first_step_measured = seconds, True

    def as_dict(self) -> dict[str, Any]:
        """The fields as summary.json writes them (run_dir as a string)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "first_step_measured" or (
                    f.name == "first_step_s" and not self.first_step_measured):
                continue
            value = getattr(self, f.name)
            out[f.name] = str(value) if f.name == "run_dir" else value
        return out
