"""Are the ranks still training one model? Compare parameters or gradients across ranks.

    from disttrain.distributed.sync_check import check_in_sync
    report = check_in_sync(model)                  # every rank calls it: it is a collective
    if not report.in_sync:
        print(report.describe())                   # which rank, which tensor, by how much

    loss.backward()
    check_in_sync(model, "grads")                  # after backward, before optimizer.step()
    check_in_sync(model, "state")                  # parameters and buffers, as a checkpoint

Why: DDP keeps the replicas identical only while every rank starts from the same weights,
all-reduces every gradient and takes the same optimizer steps. A step or a weight update
made on rank 0 only, `no_sync()` left on at an optimizer step, a custom comm hook that
drops a bucket, or buffers updated on one rank (`broadcast_buffers=False`) let them drift
apart without an error, and the loss alone does not show it; torch itself has no check
of this on a user's own model.
`disttrain verify` checks this on its own model, and the built-in Trainer checks it at
the end of every run. This module runs the same check on any model, in any script.

Cost: in the common case, one SHA-256 of every parameter and buffer plus one
`all_gather_object` of 64 hex digits. Only when the digests differ does a second pass
find the first differing tensor (per-tensor digests) and its largest absolute difference
(one broadcast of that tensor).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from disttrain.distributed.strategies import is_fsdp, model_state_dict, unwrap
from disttrain.errors import StrategyError

What = Literal["params", "grads", "state"]
_PARAM_CAUSES = ("an optimizer step or weight update made on some ranks only; a model built "
                 "with different weights on each rank and not wrapped in DDP (which "
                 "broadcasts rank 0's)")
LIKELY_CAUSES = {
    "params": _PARAM_CAUSES,
    "state": (f"{_PARAM_CAUSES}; for buffers: DDP re-broadcasts rank 0's at the start of each "
              "forward, so batch-norm statistics updated by the last forward differ until "
              "the next one (normal), or never match with broadcast_buffers=False"),
    "grads": ("backward under no_sync() at an optimizer step (gradients not all-reduced); a "
              "comm hook that does not all-reduce every bucket; a model not wrapped in DDP"),
}


@dataclass(frozen=True)
class SyncReport:
    """The outcome of `check_in_sync`, the same on every rank."""

    what: What
    digests: list[str]  # one SHA-256 per rank, over every tensor in order
    reference_rank: int  # the lowest rank holding the most common digest
    diverged_ranks: list[int]  # ranks whose digest differs from the reference's
    first_diverged: str | None = None  # the first tensor that differs on a diverged rank
    max_abs_diff: float | None = None  # its largest |difference| from the reference
    detail: str | None = None  # why no difference could be computed (shapes, names)
    scope: str | None = None  # tp/pp: what was compared among which ranks (`check_copies_in_sync`)

    @property
    def in_sync(self) -> bool:
        return not self.diverged_ranks

    @property
    def world_size(self) -> int:
        return len(self.digests)

    def describe(self) -> str:
        """One line for a log: the verdict, and on a mismatch where and the usual causes."""
        noun = {"params": "parameters", "grads": "gradients",
                "state": "parameters and buffers"}[self.what]
        if self.in_sync and self.scope:
            return f"{noun} in sync on all {self.world_size} ranks: {self.scope}"
        if self.in_sync:
            return (f"{noun} identical on all {self.world_size} ranks "
                    f"(sha256 {self.digests[0][:16]}...)")
        ranks = ", ".join(map(str, self.diverged_ranks))
        where = f" first in {self.first_diverged!r}" if self.first_diverged else ""
        size = f" (max |diff| {self.max_abs_diff:.3g})" if self.max_abs_diff is not None else ""
        detail = f"; {self.detail}" if self.detail else ""
        return (f"{noun} differ: rank(s) {ranks} differ from rank {self.reference_rank}{where}"
                f"{size}{detail}. Usual causes: {LIKELY_CAUSES[self.what]}")

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "in_sync": self.in_sync, "digests": self.digests,
                "reference_rank": self.reference_rank, "diverged_ranks": self.diverged_ranks,
                "first_diverged": self.first_diverged, "max_abs_diff": self.max_abs_diff,
                "detail": self.detail, "scope": self.scope}


def named_tensors(model: nn.Module, what: What = "params") -> list[tuple[str, torch.Tensor | None]]:
    """What is compared, in state_dict order.

    "state" is the full state_dict (FSDP gathers it: a collective); "params" the same
    without buffers, which DDP keeps in step only from one forward to the next; "grads"
    each trainable parameter's `.grad` (None where backward gave it none).
    """
    if what == "grads":
        if is_fsdp(model):
            raise StrategyError("FSDP shards gradients across ranks, so they differ by design; "
                                "check parameters (what='params') instead")
        return [(n, p.grad) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    if what not in ("params", "state"):
        raise ValueError(f"what must be 'params', 'grads' or 'state', not {what!r}")
    state = model_state_dict(model)
    if what == "state":
        return list(state.items())
    buffers = {_clean(n) for n, _ in unwrap(model).named_buffers()}
    return [(n, t) for n, t in state.items() if n not in buffers]


def _clean(name: str) -> str:
    """A module path as state_dict names it (FSDP1 and checkpoint wrappers add a level)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(items: Iterable[tuple[str, Any]]) -> str:
    """SHA-256 over names and tensor bytes, in order (of `model_state_dict(model).items()`:
    the `params_sha256` of a run's summary)."""
    h = hashlib.sha256()
    for name, t in items:
        h.update(name.encode())
        if isinstance(t, torch.Tensor):
            h.update(tensor_bytes(t))
        elif t is None:
            h.update(b"<none>")
    return h.hexdigest()


def reference(digests: list[str]) -> tuple[int, list[int]]:
    """The lowest rank with the most common digest, and the ranks that differ from it."""
    counts = Counter(digests)
    top = max(counts.values())
    ref = next(r for r, d in enumerate(digests) if counts[d] == top)
    return ref, [r for r, d in enumerate(digests) if d != digests[ref]]


def check_in_sync(model: nn.Module, what: What = "params") -> SyncReport:
    """Compare `model`'s parameters (and buffers) or gradients over all ranks.

    Every rank of the default process group must call it at the same point. Without a
    process group it reports a single, trivially consistent rank.

    Args:
        model: the bare model or its DDP / FSDP / DataParallel wrapper. Under FSDP the
            full parameters are gathered; each shard exists once, so only replicated
            tensors (buffers, hybrid sharding's replicas across nodes) can differ.
        what: "params" (after an optimizer step), "grads" (after backward, before
            `optimizer.step()`) or "state" (parameters and buffers, what a checkpoint holds).

    Returns:
        The same SyncReport on every rank.

    Example:
        >>> report = check_in_sync(ddp_model)
        >>> assert report.in_sync, report.describe()
    """
    items = named_tensors(model, what)
    mine = digest(items)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SyncReport(what, [mine], 0, [])
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, mine)
    ref, diverged = reference(digests)
    if not diverged:
        return SyncReport(what, digests, ref, [])
    return _locate(items, digests, ref, diverged, what)


def _locate(items: list[tuple[str, Any]], digests: list[str], ref: int, diverged: list[int],
            what: What) -> SyncReport:
    """Second pass, only on a mismatch: the first differing tensor and by how much."""
    mine = [(n, None if t is None else (tuple(t.shape), str(t.dtype), digest([("", t)])))
            for n, t in items]
    everyone: list[Any] = [None] * len(digests)
    dist.all_gather_object(everyone, mine)
    first = everyone[diverged[0]]
    want = everyone[ref]
    if [n for n, _ in first] != [n for n, _ in want]:
        return SyncReport(what, digests, ref, diverged,
                          detail="the ranks hold different tensor names (different models)")
    index = next(i for i, (a, b) in enumerate(zip(first, want)) if a[1] != b[1])
    name, meta = want[index]
    other = first[index][1]
    if meta is None or other is None or meta[:2] != other[:2]:
        def show(m: Any) -> str:
            return "no gradient" if m is None else f"shape {list(m[0])} {m[1]}"

        return SyncReport(what, digests, ref, diverged, first_diverged=name,
                          detail=f"{show(other)} on rank {diverged[0]}, {show(meta)} on rank {ref}")
    diff = _max_abs_diff(items[index][1], meta, ref, len(digests))
    return SyncReport(what, digests, ref, diverged, first_diverged=name, max_abs_diff=diff)


def _max_abs_diff(t: torch.Tensor | None, meta: tuple[Any, ...], ref: int,
                  world: int) -> float | None:
    """Broadcast the reference rank's copy; the largest |difference| on any rank.

    `meta` is the reference's (shape, dtype, digest), so a rank without this tensor (no
    gradient) can still take part in the broadcast.
    """
    cuda = dist.get_backend() == "nccl"
    if t is None:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        theirs = torch.empty(meta[0], dtype=getattr(torch, meta[1].removeprefix("torch.")),
                             device=device)
    else:
        device = t.device if cuda else torch.device("cpu")
        theirs = t.detach().to(device, copy=True).contiguous()
    dist.broadcast(theirs, src=ref)
    local = None
    if t is not None:
        mine = t.detach().to(device)
        if not t.is_complex():  # integer and bool buffers too (e.g. num_batches_tracked)
            mine, theirs = mine.double(), theirs.double()
        local = float((mine - theirs).abs().max()) if t.numel() else 0.0
    diffs: list[Any] = [None] * world
    dist.all_gather_object(diffs, local)
    known = [d for d in diffs if d is not None]
    return max(known) if known else None


# -- tensor / pipeline parallel: each copy compared among the ranks that hold it ------------
def dtensor_copies(model: nn.Module, what: What = "state") -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors keyed by which copy they are: a DTensor's local shard as
    `name@coordinates` along the mesh dimensions it is sharded over (so ranks that differ
    only in a replicated dimension, the data-parallel ranks, hold the same key), anything
    replicated or plain under its name (every rank holding it must agree)."""
    from torch.distributed.tensor import DTensor, Replicate

    named = (unwrap(model).state_dict().items() if what == "state"
             else unwrap(model).named_parameters())
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if isinstance(t, DTensor):
            coord = t.device_mesh.get_coordinate() or []
            sharded = [f"{t.device_mesh.mesh_dim_names[i] if t.device_mesh.mesh_dim_names else i}"
                       f"={coord[i]}" for i, p in enumerate(t.placements) if not isinstance(p, Replicate)]
            out.append((f"{name}@{','.join(sharded)}" if sharded else name, t.to_local()))
        else:
            out.append((name, t))
    return out


def check_copies_in_sync(items: list[tuple[str, torch.Tensor]], what: What = "state") -> SyncReport:
    """Compare each keyed tensor among the ranks that hold the same key (`dtensor_copies`;
    a pipeline stage's parameters under their model names, a tied weight's copies on two
    stages under one name). A key held by one rank only (a tp shard or a stage's own
    layer when there is no data parallelism) has nothing to compare: counted, not failed.

    A collective over the default group: one `all_gather_object` of {key: sha256}.
    `digests` are per rank over its own tensors (they differ by design: different shards).
    """
    mine = {key: digest([("", t)]) for key, t in items}
    own = digest(sorted(items, key=lambda kv: kv[0]))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SyncReport(what, [own], 0, [], scope="one rank")
    world = dist.get_world_size()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (own, mine))
    holders: dict[str, list[int]] = {}
    for rank, (_, keys) in enumerate(everyone):
        for key in keys:
            holders.setdefault(key, []).append(rank)
    diverged: set[int] = set()
    first, ref_rank, shared = None, 0, 0
    for key, ranks in holders.items():
        if len(ranks) < 2:
            continue
        shared += 1
        ref, bad = reference([everyone[r][1][key] for r in ranks])
        if bad:
            diverged.update(ranks[i] for i in bad)
            if first is None:
                first, ref_rank = key, ranks[ref]
    single = len(holders) - shared
    scope = (f"{shared} tensor(s) held by several ranks compared among their holders"
             + (f"; {single} held by one rank only (a shard or a stage's own tensor with no "
                f"data-parallel replica: nothing to compare)" if single else ""))
    return SyncReport(what, [d for d, _ in everyone], ref_rank, sorted(diverged),
                      first_diverged=first, scope=scope)
