"""What a user script does besides optimizer steps, seen from outside its code: the process
group's creation, its collectives and its forward passes (docs/resilience.md, "Scripts").

    probes = DistProbes(heartbeat_of=hooks.mine, on_group=hooks.watch)
    probes.install(torch.distributed)    # init_process_group starts the watch; collectives are marked
    first = FirstForward(hooks.forward_started); first.arm()   # again after each optimizer step

Why: the watchdog can only be fair to a script if it sees the script's progress and waits.
An optimizer step alone (`script_heartbeat`) misses three things a script does:
- a rank can hang before its first step (in setup, or blocked in its first all-reduce):
  watching starts when `init_process_group` returns, not at the first step;
- rank 0 may evaluate for longer than the timeout while the others wait at a barrier:
  forward passes are progress (a global forward pre-hook marks a step's first one,
  `FirstForward`; the heartbeat's thread sees the main thread execute the others), and a
  rank inside a collective records which one (`Heartbeat.in_coll`), so the watchdog judges
  it by whether a rank outside any collective still progresses (`watchdog.Watchdog.judge`);
- the ranks enter collectives in one order, so the rank that entered fewer (`Heartbeat.coll`)
  is the one the others wait for: it is the one named.

Cost: the hooks only write attributes (`seq += 1`) that the heartbeat's thread reads and
publishes every interval; nothing here does I/O. A collective pays one Python call around
it; the forward hook fires once per optimizer step (`FirstForward`).

The public collectives of `torch.distributed` are wrapped where the script looks them up
(the `torch.distributed` namespace), plus the two that DDP's constructor calls through it
(`_verify_params_across_processes`, `_broadcast_coalesced`); DDP's gradient all-reduce
runs in C++ during backward and is seen as the `backward` phase, not as a collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from disttrain.resilience.heartbeat import Heartbeat

# Blocking calls of torch.distributed that wait for other ranks.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
    # what DistributedDataParallel's constructor calls through `torch.distributed`
    "_verify_params_across_processes", "_broadcast_coalesced",
)
_WRAPPED = "__disttrain_probe__"


class DistProbes:
    """Wrappers around `torch.distributed`'s init_process_group and collectives.

    Args:
        heartbeat_of: this process's script heartbeat, or None (not started, or the
            Trainer's own runs: then nothing is marked).
        on_group: called when a process group exists (after init_process_group, or at
            the first collective of a group made another way): starts the heartbeat.
    """

    def __init__(self, heartbeat_of: Callable[[], Heartbeat | None],
                 on_group: Callable[[], None]) -> None:
        self.heartbeat_of, self.on_group = heartbeat_of, on_group
        self._depth = 0
        self._saved: list[tuple[ModuleType, str, Any]] = []

    def install(self, dist: ModuleType) -> None:
        """Wrap the names in `dist` (torch.distributed); idempotent, undone by `remove`."""
        if not getattr(dist, "is_available", lambda: False)():
            return
        init = getattr(dist, "init_process_group", None)
        if init is not None and not hasattr(init, _WRAPPED):
            self._set(dist, "init_process_group", self._init(init))
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and not hasattr(fn, _WRAPPED):
                self._set(dist, name, self._collective(name, fn))

    def remove(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _set(self, module: ModuleType, name: str, wrapper: Any) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(wrapper, _WRAPPED, True)
        setattr(module, name, wrapper)

    def _init(self, init: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = init(*args, **kwargs)
            self.on_group()   # the group exists: from now on a silent rank is judged
            return result

        return init_process_group

    def _collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            hb = self.heartbeat_of()
            if hb is None:
                self.on_group()   # a group made without init_process_group (a device mesh)
                hb = self.heartbeat_of()
            if hb is None or self._depth:   # nested (all_gather_object -> all_gather): once
                return fn(*args, **kwargs)
            self._depth += 1
            phase = hb.phase
            hb.coll += 1
            hb.in_coll = hb.phase = name
            hb.seq += 1
            try:
                return fn(*args, **kwargs)
            finally:
                hb.in_coll, hb.phase = "", phase
                hb.seq += 1
                self._depth -= 1

        return collective


class FirstForward:
    """A global forward pre-hook (`torch.nn.modules.module.register_module_forward_pre_hook`)
    armed once per optimizer step: the step's first module call (the model's own forward)
    runs `on_forward` and removes it, so the calls after it, the model's submodules
    included, keep nn.Module's fast path. Always on, the hook costs every module call
    nn.Module's hooked path (+7 us per call measured here: +1 ms per forward of a
    ResNet-50); once per step it costs nothing measurable. The forwards after the first
    are still progress: the heartbeat's thread sees the main thread executing
    (`script_heartbeat._MainThreadMoves`)."""

    def __init__(self, on_forward: Callable[[], None]) -> None:
        self.on_forward = on_forward
        self._handle: Any = None

    def arm(self) -> None:
        if self._handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._handle = register_module_forward_pre_hook(self._fired)

    def _fired(self, module: Any, args: Any) -> None:
        self.remove()   # safe inside the hook: nn.Module iterates over a copy of the hooks
        self.on_forward()

    def remove(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
