"""DDP gradient communication hooks ("gradient compression"), with real byte counts.

    stats = register_comm_hook(ddp_model, "fp16", total_steps=1000)
    ...train...
    stats.end_step()          # once per optimizer step (the Trainer does it)
    stats.last_bytes          # bytes handed to all_reduce in the last optimizer step

The hooks are torch's own (`torch.distributed.algorithms.ddp_comm_hooks`): `none` is
`allreduce_hook` (what DDP does built in), `fp16` / `bf16` compress each bucket to half
precision before the all-reduce, `powersgd` sends a rank-r approximation (Vogels et al.).
Every hook is wrapped by a counter that sees each `dist.all_reduce` the hook issues and
adds up the bytes of the tensors it really sends, including PowerSGD's P and Q matrices
and the ones it sends from future callbacks. So `allreduce_bytes_per_step` in
summary.json is measured, not computed from parameter counts, and a test can check that
gradient accumulation gives exactly one all-reduce per optimizer step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from disttrain.distributed.comm_wait import WaitTuner, choose_wait, local_ranks_here
from disttrain.errors import StrategyError
from disttrain.spec.fields import COMM_HOOKS

_LOCK = threading.Lock()
_INFLIGHT: dict[int, CommStats] = {}   # id(stats) -> stats with a hook call in progress
_ORIGINAL_ALL_REDUCE: Callable[..., Any] | None = None


@dataclass
class CommStats:
    """All-reduces a DDP model's comm hook issued: per optimizer step and in total."""

    calls: int = 0             # since the last end_step()
    bytes: int = 0
    hook_calls: int = 0        # buckets handed to the hook since the last end_step()
    last_calls: int = 0        # in the last optimizer step that communicated
    last_bytes: int = 0
    last_hook_calls: int = 0
    total_bytes: int = 0
    total_calls: int = 0
    total_hook_calls: int = 0
    steps: int = 0
    wait: str | None = None    # how the step's last all-reduce is awaited, when not tuned
    tuner: WaitTuner | None = field(default=None, repr=False, compare=False)   # when it is tuned
    _inflight: int = field(default=0, repr=False)
    # Called when the hook gets a step's last bucket: all gradients are ready, so the
    # rest of backward is the wait for the all-reduce (train/step_timing.py splits there).
    on_last_bucket: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def end_step(self) -> None:
        """Close one optimizer step: remember its counts and start the next."""
        with _LOCK:
            if self.hook_calls:
                self.last_calls, self.last_bytes = self.calls, self.bytes
                self.last_hook_calls = self.hook_calls
            self.total_bytes += self.bytes
            self.total_calls += self.calls
            self.total_hook_calls += self.hook_calls
            self.steps += 1
            self.calls = self.bytes = self.hook_calls = 0

    def summary(self) -> dict[str, Any]:
        """The summary.json entries (steady state: the last step that communicated)."""
        out: dict[str, Any] = {
            "allreduce_bytes_per_step": self.last_bytes, "allreduce_calls_per_step": self.last_calls,
            "allreduce_bytes_mean": round(self.total_bytes / self.steps) if self.steps else 0}
        if self.tuner is not None:
            out["comm_wait"] = self.tuner.describe()
        elif self.wait is not None:
            out["comm_wait"] = self.wait
        return out


def _counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`dist.all_reduce` that reports the bytes it sends to every hook call in flight."""
    if _INFLIGHT:
        n = tensor.numel() * tensor.element_size()
        with _LOCK:
            for stats in _INFLIGHT.values():
                stats.calls += 1
                stats.bytes += n
    assert _ORIGINAL_ALL_REDUCE is not None
    return _ORIGINAL_ALL_REDUCE(tensor, *args, **kwargs)


def _install_counter() -> None:
    # NOTE: torch's hooks call `dist.all_reduce` by module attribute, also from future
    # callbacks on gloo/NCCL threads (PowerSGD's second and third all-reduce), so the
    # only place that sees every byte is that attribute. The wrapper counts only while a
    # counted hook call is in flight; any other all_reduce passes through untouched.
    global _ORIGINAL_ALL_REDUCE
    if _ORIGINAL_ALL_REDUCE is None:
        _ORIGINAL_ALL_REDUCE = dist.all_reduce
        dist.all_reduce = _counting_all_reduce  # type: ignore[assignment]


def counting(hook: Callable[[Any, Any], torch.futures.Future], stats: CommStats,
             poll_last: bool = False) -> Callable[[Any, Any], torch.futures.Future]:
    """Wrap a DDP comm hook so `stats` sees every bucket and every byte it all-reduces.

    With `poll_last`, the hook of the step's last bucket waits for its all-reduce by
    polling with sched_yield() instead of letting DDP block on it (see `yield_until_done`);
    with a `stats.tuner`, in the steps the tuner says to poll instead.
    """
    tuner = stats.tuner
    _install_counter()

    def leave() -> None:
        with _LOCK:
            stats._inflight -= 1
            if stats._inflight == 0:
                _INFLIGHT.pop(id(stats), None)

    def done(fut: torch.futures.Future) -> Any:
        leave()
        return fut.value()

    # NOTE: no annotations: DDP rejects a hook whose `bucket` / return annotations are
    # not exactly dist.GradBucket / Future[Tensor] (strings, under postponed evaluation).
    def wrapped(state, bucket):  # type: ignore[no-untyped-def]
        last = bucket.is_last()
        if last and stats.on_last_bucket is not None:
            stats.on_last_bucket()
        with _LOCK:
            stats.hook_calls += 1
            stats._inflight += 1
            _INFLIGHT[id(stats)] = stats
        try:
            fut = hook(state, bucket)
        except BaseException:
            leave()
            raise
        result = fut.then(done)
        if last and (tuner.poll_now(time.perf_counter()) if tuner is not None else poll_last):
            yield_until_done(result)
        return result

    wrapped.__name__ = f"counting_{getattr(hook, '__name__', 'hook')}"
    return wrapped


def yield_until_done(fut: torch.futures.Future) -> None:
    """Wait for `fut` by polling with sched_yield() (which releases the GIL) instead of
    sleeping on it.

    NOTE: measured on the 2-vCPU VM this project is tested on (docs/performance.md): in a
    training loop a gloo all-reduce of 1.6 MB took ~2.7-3.9 ms when the waiting thread
    sleeps, ~1.6-2.2 ms when it yields, ~1.4 ms back to back. A sleeping thread lets its
    vCPU halt, and every one of the several thread hand-offs inside gloo then pays a
    wake-up. Polling happens only for the last bucket of a step, when backward has no
    compute left to overlap and the thread would block right after anyway; only for gloo
    (CPU): NCCL's waits are on CUDA streams; and only when a core is free for it
    (`comm_wait.choose_wait`, then `comm_wait.WaitTuner` from the step times: under CPU
    contention it loses to blocking).
    """
    while not fut.done():
        os.sched_yield()


def powersgd_start_iter(total_steps: int) -> int:
    """Vanilla all-reduce for the first ~10% of steps, as torch's PowerSGD docs advise
    (at least 2: error feedback needs one uncompressed step), at most torch's 1000."""
    return max(2, min(1000, total_steps // 10))


def register_comm_hook(model: Any, name: str, total_steps: int = 1000, rank: int = 1,
                       process_group: Any = None, poll: bool = False) -> CommStats:
    """Register torch's comm hook `name` on a DDP model, wrapped by a byte counter.

    Args:
        model: a DistributedDataParallel module (before its first forward).
        name: none | fp16 | bf16 | powersgd.
        total_steps: planned optimizer steps (sets PowerSGD's start iteration).
        rank: PowerSGD's matrix approximation rank.
        process_group: the group to reduce over (default: the whole world).
        poll: the backend allows waiting for the step's last all-reduce with
            `yield_until_done` (gloo on CPU); whether it does is `comm_wait.choose_wait`'s
            call, made here from the CPUs this rank may use and how busy they are, and
            then, where they allow polling, `comm_wait.WaitTuner`'s from the step times.

    Returns:
        The CommStats that counts what the hook sends.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    stats = CommStats()
    state: Any = process_group
    hook: Callable[[Any, Any], torch.futures.Future]
    if name == "none":
        hook = default_hooks.allreduce_hook
    elif name == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif name == "bf16":
        hook = default_hooks.bf16_compress_hook
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank,
            start_powerSGD_iter=powersgd_start_iter(total_steps), min_compression_rate=2,
            use_error_feedback=True, warm_start=True, random_seed=0)
        hook = powerSGD_hook.powerSGD_hook
    else:
        raise StrategyError(f"unknown comm_hook {name!r}; choose one of {', '.join(COMM_HOOKS)}")
    if poll:
        choice = choose_wait(local_ranks_here(), torch.get_num_threads())
        poll = choice.poll
        if choice.tunable:   # its summary says the first choice too (WaitTuner.describe)
            stats.tuner = WaitTuner(choice)
        else:
            stats.wait = choice.describe()
    model.register_comm_hook(state, counting(hook, stats, poll_last=poll))
    return stats
