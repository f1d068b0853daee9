"""What a rank really used, measured during the run, for summary.json and the live files.

    probe = MemoryProbe(model, optimizer, device)
    probe.before_micro(batch)      # Trainer.train_step, before the forward
    probe.after_step(step)         # Trainer.optimizer_step, after the update
    probe.fields()                 # {"memory_source": ..., "tensor_peak_bytes": ..., ...}

On CUDA it reads the caching allocator's `max_memory_reserved` and `mem_get_info`'s
total - free: inside a HAMi container that is HAMi-core's own count of the slice (its
hooked `cuMemGetInfo_v2` returns the limit as total and limit - usage of every process of
the container as free, src/cuda/memory.c), the number a slice must hold. On the CPU there
is no allocator to ask, so the same fields hold the tensor peak torch's memory tracker
(`torch.distributed._tools.mem_tracker`) sees over the first two optimizer steps, the
figure `disttrain plan` predicts (docs/memory.md). Either way the cost is bounded: a
tracked CPU run pays the tracker's dispatch only for two steps, a CUDA run one
`mem_get_info` per `SAMPLE_EVERY` steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

MIB = 2**20
TRACKED_STEPS = 2     # the plan traces two optimizer steps; the CPU probe tracks as many
SAMPLE_EVERY = 10     # CUDA: mem_get_info once per this many optimizer steps


class MemoryProbe:
    """One rank's memory figures (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        self.model, self.optimizer, self.device = model, optimizer, device
        self.cuda = device.type == "cuda"
        self.tensor_peak = 0
        self.slice_used = 0
        self.steps = 0
        self._tracker: Any = None
        self._fsdp2 = isinstance(model, FSDPModule)
        # Decided once, from the model: the CPU tracker cannot follow FSDP1 (its original
        # parameters are views of a flat one, and the tracker's gradient hooks refuse
        # non-leaf tensors) nor a frozen parameter (it hooks every parameter's gradient and
        # raises, "cannot register a hook on a tensor that doesn't require gradient": a LoRA
        # base, recipes/causal_lm.py). Those runs are not tracked.
        self._trackable = not self.cuda and not isinstance(model, FullyShardedDataParallel) \
            and all(p.requires_grad for p in model.parameters())

    # -- hooks the Trainer calls ---------------------------------------------------
    def before_micro(self, batch: Any) -> None:
        """Start tracking (CPU, first steps only) before a micro-batch's forward."""
        if self._tracker is not None:
            # the next micro-batch of an accumulated step (or another forward of the same
            # step): the tracker's per-module stats hold one forward each and it raises on a
            # second ("multiple iterative calls"); its global peak is kept apart and survives
            self._tracker.reset_mod_stats()
            return
        if not self._trackable or self.steps >= TRACKED_STEPS:
            return
        self._tracker = self._new_tracker()
        self._tracker.track_external(self.model, self.optimizer,
                                     *[t for t in tree_flatten(batch)[0]
                                       if isinstance(t, torch.Tensor)])
        self._tracker.reset_mod_stats()
        self._tracker.__enter__()

    def after_step(self, step: int) -> None:
        """After an optimizer step: close the step's tracking, or sample the device."""
        self.steps += 1
        if self._tracker is not None:
            self._close()
        elif self.cuda and (step <= TRACKED_STEPS or step % SAMPLE_EVERY == 0):
            self._sample_cuda()

    def live_fields(self) -> dict[str, Any]:
        """The figures so far, for the live file: no device call, no tracker closing."""
        used = self.slice_used if self.cuda else self.tensor_peak
        return {"slice_used_mib": round(used / MIB, 1)} if used else {}

    def fields(self) -> dict[str, Any]:
        """This rank's figures for summary.json's `ranks` and the live files."""
        if self._tracker is not None:
            self._close()
        if self.cuda:
            self._sample_cuda()
            reserved = torch.cuda.max_memory_reserved(self.device)
            return {"memory_source": "cuda",
                    "tensor_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "peak_reserved_mib": round(reserved / MIB, 1),
                    "slice_used_mib": round(self.slice_used / MIB, 1)}
        mib = round(self.tensor_peak / MIB, 1)
        return {"memory_source": "tracker" if self.tensor_peak else "none",
                "tensor_peak_bytes": self.tensor_peak,
                "peak_reserved_mib": mib, "slice_used_mib": mib}

    # -- the two ways of measuring -------------------------------------------------
    def _new_tracker(self) -> Any:
        if self._fsdp2:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            return FSDPMemTracker(self.model, self.optimizer)
        from torch.distributed._tools.mem_tracker import MemTracker

        return MemTracker()

    def _close(self) -> None:
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        for snap in tracker.get_tracker_snapshot("peak").values():
            self.tensor_peak = max(self.tensor_peak, int(snap.get("Total", 0)))

    def _sample_cuda(self) -> None:
        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except RuntimeError:   # HAMi: usage above the limit answers CUDA_ERROR_INVALID_VALUE
            return
        self.slice_used = max(self.slice_used, total - free)
