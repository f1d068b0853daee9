"""Activations between pipeline stages outside torch's schedules: evaluation's forward.

    link = StageLink(group)
    link.send(h, dst, stage)           # stage `stage`'s output; returns at once
    h = link.recv(src, stage, device)  # the next output of `stage`, once it has arrived
    link.wait()                        # every send of this link has completed

torch's schedules run the training step; an evaluation pass is a plain forward through the
stages, which needs only point-to-point sends. Two things make it cheap on gloo, where a
message costs a fixed ~0.1-1 ms whatever its size (docs/performance.md):

- the sends are `isend`s, so a stage goes on to its next micro-batch while the one after
  it computes the last (a wavefront; `disttrain.train.model_parallel.PipelineEvaluator`);
- a stage's output has the same shape and dtype on every micro-batch (its traced shape),
  so only the first tensor on each (sender, stage) carries the 8-number header that tells
  the receiver what to allocate; the receiver remembers it per stage.

Sends between two ranks are matched in the order they were posted (gloo keeps one queue
per peer and tag), so the receiver reads a stage's tensors in the order its sender made them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disttrain.errors import StrategyError

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEAD = 8   # ndim, dtype code, up to 6 sizes


class StageLink:
    """Point-to-point activations of one pipeline group, headers once per stage."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._told: set[tuple[int, int]] = set()                 # (dst, stage) headers sent
        self._known: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []       # (work, tensor kept alive)

    def send(self, t: torch.Tensor, dst: int, stage: int) -> None:
        """Send stage `stage`'s output `t` to rank `dst` without waiting for it."""
        t = t.contiguous()
        if (dst, stage) not in self._told:
            if t.dtype not in _DTYPES or t.ndim > _HEAD - 2:
                raise StrategyError(f"pipeline evaluation: cannot pass a {t.dtype} tensor of "
                                    f"{t.ndim} dims between stages")
            head = torch.zeros(_HEAD, dtype=torch.int64)
            head[0], head[1] = t.ndim, _DTYPES.index(t.dtype)
            head[2:2 + t.ndim] = torch.tensor(t.shape)
            head = head.to(t.device)
            self._pending.append((dist.isend(head, dst=dst, group=self.group), head))
            self._told.add((dst, stage))
        self._pending.append((dist.isend(t, dst=dst, group=self.group), t))

    def recv(self, src: int, stage: int, device: torch.device) -> torch.Tensor:
        """The next output of stage `stage` from rank `src`."""
        key = (src, stage)
        if key not in self._known:
            head = torch.zeros(_HEAD, dtype=torch.int64, device=device)
            dist.recv(head, src=src, group=self.group)
            ndim, code = int(head[0]), int(head[1])
            self._known[key] = (tuple(int(v) for v in head[2:2 + ndim]), _DTYPES[code])
        shape, dtype = self._known[key]
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=self.group)
        return t

    def wait(self) -> None:
        """Wait for every send posted so far (their tensors are freed after)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
