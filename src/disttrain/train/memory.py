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
# What FSDP2's CPUOffloadPolicy keeps in host memory, by the trackers' category names: the
# rank's shards, their gradients once reduce-scattered, and the optimizer state made from
# them. Buffers and the gathered (unsharded) parameters and gradients stay on the device.
OFFLOADED = frozenset({"Sharded Param", "Sharded Grad", "Optstate", "OptState"})


def peak_only(tracker_class: type, host: frozenset[str] = frozenset()) -> type:
    """`tracker_class` (MemTracker or FSDPMemTracker) keeping only its global peak, of the
    device: the categories in `host` (CPU offload: `OFFLOADED`) are left out of it.

    After every op MemTracker compares the memory with the peak of every module it has
    seen (`_update_peak_stats` walks all of `memory_tracking`): ops x modules, minutes for
    a 28-layer decoder, and neither the plan nor the probe reads those per-module peaks.
    The global peak is kept as torch keeps it, less the host categories: on a CPU trace
    (or a CPU run) the offloaded state is on the same device as the rest, so the tracker
    cannot tell them apart by device. `_update_peak_stats` is private: tests/plan/
    test_tracker_contract.py fails when torch changes how it is called."""

    class PeakOnly(tracker_class):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                total = dev_snap["Total"] - on_host(dev_snap, host)
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = {**dev_snap, "Total": total}

    PeakOnly.__name__ = f"PeakOnly{tracker_class.__name__}"
    return PeakOnly


def on_host(snapshot: dict[Any, int], host: frozenset[str]) -> int:
    """The bytes of a tracker snapshot's categories named in `host`."""
    return sum(int(v) for k, v in snapshot.items() if getattr(k, "value", k) in host)


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
        # non-leaf tensors); those runs are not tracked. Frozen parameters (a LoRA base,
        # recipes/causal_lm.py) are, by train/frozen_tracking.py's tracker.
        self._trackable = not self.cuda and not isinstance(model, FullyShardedDataParallel)
        # CPU offload (train.cpu_offload): the figure is the device's, as the plan's, so the
        # offloaded state is left out although on the CPU it lies beside the rest
        from disttrain.distributed.fsdp import cpu_offloaded

        self._host = OFFLOADED if self._fsdp2 and cpu_offloaded(model) else frozenset()

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

            if self._host:
                return peak_only(FSDPMemTracker, self._host)(self.model, self.optimizer)
            return FSDPMemTracker(self.model, self.optimizer)
        from torch.distributed._tools.mem_tracker import MemTracker

        from disttrain.train.frozen_tracking import frozen_aware

        return frozen_aware(MemTracker)()

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
