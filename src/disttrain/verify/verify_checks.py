"""The checks of `disttrain verify`, in one file that needs nothing but torch.

    torchrun --nproc_per_node=2 verify_checks.py --json   # this file alone, e.g. in a pod
    results = run_checks(rt)          # inside any live process group; all ranks' results

A deployment is usually verified by hand: the same PyTorch version on all nodes, the loss
converging on every node, the nodes in sync. Each is a check here (CHECKS, described in
docs/verify-and-bench.md), judged on every rank against an exact expectation.

One torch-only file, because `disttrain k8s verify` ships it in the job's ConfigMap and runs
it with torchrun, so the check works in a plain `pytorch/pytorch` image. Where disttrain is
importable the process group comes from `disttrain.distributed.runtime`, as for every job;
the launcher side is `disttrain.verify.runner`. Fault injection (tests only):
`<check>:<rank>[,<check>:<rank>]` in FAULT_ENV, or the hidden `disttrain verify --fault`,
makes <rank> break <check> the way a real fault would (docs/verify-and-bench.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

CHECKS = ("consistency", "all_reduce_sum", "all_reduce_avg", "all_reduce_max", "broadcast",
          "all_gather", "reduce_scatter", "barrier", "gradient_sync", "convergence")
# NOTE: declared in disttrain/envvars.py (VERIFY_FAULT) with every other variable; spelled
# out here because this file runs in pods without disttrain (a test keeps the two equal).
FAULT_ENV = "DISTTRAIN_VERIFY_FAULT"
CONVERGENCE_MARGIN = 0.3      # the loss must fall by at least 30 % on every rank
DEFAULT_STEPS = 100           # DDP steps of the gradient-sync / convergence run
SIZES = (1, 1031, (1 << 20) + 3)
SIZES_TEXT = "/".join(f"{n:,}" for n in SIZES) + " elements"
_barrier_calls = 0            # makes the barrier's store key unique per call, equal on all ranks


class RankLike(Protocol):
    """What the checks need from a runtime (`disttrain.distributed.runtime.Runtime` has it)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


@dataclass
class CheckResult:
    """One check on one rank. `to_json` gives the `--json` line."""

    check: str
    rank: int
    ok: bool
    detail: str
    time_s: float = 0.0
    host: str = ""
    local_rank: int = 0
    device: str = ""
    backend: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_faults(text: str | None) -> dict[str, set[int]]:
    """`"barrier:1,convergence:0"` -> {"barrier": {1}, "convergence": {0}}; ValueError for an
    item that is not <check>:<rank> with a known check."""
    faults: dict[str, set[int]] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        check, sep, rank = item.partition(":")
        if check not in CHECKS or not sep or not rank.isdigit():
            raise ValueError(f"{FAULT_ENV}: {item!r} is not <check>:<rank> with <check> one of "
                             f"{', '.join(CHECKS)}")
        faults.setdefault(check, set()).add(int(rank))
    return faults


# -- the checks -------------------------------------------------------------------------
class _Checker:
    """The checks of one rank; each returns (ok, detail) for this rank."""

    def __init__(self, rt: RankLike, faults: dict[str, set[int]], steps: int):
        self.rt, self.faults, self.steps = rt, faults, steps
        self.rank, self.n, self.device = rt.rank, rt.world_size, rt.device
        self._trained: tuple[str, list[float]] | None = None

    def faulty(self, check: str) -> bool:
        return self.rank in self.faults.get(check, ())

    def _inject(self, check: str, t: torch.Tensor) -> torch.Tensor:
        if self.faulty(check):
            t.view(-1)[0] += 1
        return t

    def _base(self, numel: int) -> torch.Tensor:
        # Integers 1..7: sums stay exact in float32 (below 2^24) up to 2,048 ranks.
        return (torch.arange(numel, device=self.device) % 7 + 1).float()

    # collectives ------------------------------------------------------------------
    # Every rank runs every collective of a check even after a mismatch: a rank that
    # stopped early would leave the others waiting in a collective it never joins.
    def all_reduce(self, op: str) -> tuple[bool, str]:
        n, how, bad = self.n, f"ReduceOp.{op.upper()}", None
        coef = {"sum": n * (n + 1) / 2, "max": float(n), "avg": (n + 1) / 2}[op]
        for numel in SIZES:
            base = self._base(numel)
            t = base * (self.rank + 1)
            if op == "avg":
                t, how = self._avg(t, base)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            bad = bad or _compare(self._inject(f"all_reduce_{op}", t), base * coef, exact=op != "avg")
        if bad:
            return False, f"{bad} ({how})"
        # NCCL's AVG multiplies by 1/n before summing: equal within rounding, not bitwise.
        return True, f"{'exact' if op != 'avg' else 'within 1e-6'} on {SIZES_TEXT} ({how})"

    def _avg(self, t: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, str]:
        try:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            return t, "ReduceOp.AVG"
        except (RuntimeError, ValueError, AttributeError):
            # Older gloo has no AVG (torch 2.1 of the guide's image): SUM / world size.
            t = base * (self.rank + 1)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t / self.n, f"SUM / world size: {self.rt.backend} has no ReduceOp.AVG"

    def broadcast(self) -> tuple[bool, str]:
        sources, bad = sorted({0, self.n - 1}), None
        for src in sources:
            for numel in SIZES:
                base = self._base(numel)
                t = base * (self.rank + 1)
                dist.broadcast(t, src=src)
                found = _compare(self._inject("broadcast", t), base * (src + 1))
                bad = bad or (found and f"{found} (from rank {src})")
        if bad:
            return False, bad
        return True, f"exact from ranks {sources} on {SIZES_TEXT}"

    def all_gather(self) -> tuple[bool, str]:
        fn = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
        apis, bad = ["all_gather"], None
        for numel in SIZES:
            base = self._base(numel)
            want = torch.cat([base * (r + 1) for r in range(self.n)])
            parts = [torch.empty_like(base) for _ in range(self.n)]
            dist.all_gather(parts, base * (self.rank + 1))
            results = [torch.cat(parts)]
            if fn is not None:
                out = torch.empty(numel * self.n, device=self.device)
                try:
                    fn(out, base * (self.rank + 1))
                    results.append(out)
                    if fn.__name__ not in apis:
                        apis.append(fn.__name__)
                except (RuntimeError, ValueError):
                    fn = None  # e.g. gloo in old torch: the list API alone
            for got in results:
                bad = bad or _compare(self._inject("all_gather", got), want)
        if bad:
            return False, bad
        return True, f"exact on {SIZES_TEXT} ({', '.join(apis)})"

    def reduce_scatter(self) -> tuple[bool, str]:
        n, how, bad = self.n, "", None
        for numel in SIZES:
            full = self._base(numel * n)
            inp = full * (self.rank + 1)
            want = full[self.rank * numel:(self.rank + 1) * numel] * (n * (n + 1) / 2)
            out, how = self._reduce_scatter(inp, numel)
            bad = bad or _compare(self._inject("reduce_scatter", out), want)
        if bad:
            return False, f"{bad} ({how})"
        return True, f"exact on {SIZES_TEXT} per rank ({how})"

    def _reduce_scatter(self, inp: torch.Tensor, numel: int) -> tuple[torch.Tensor, str]:
        out = torch.empty(numel, device=self.device)
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            try:
                fn(out, inp.clone())
                return out, name
            except (RuntimeError, ValueError):
                break
        try:
            dist.reduce_scatter(out, list(inp.clone().chunk(self.n)))
            return out, "reduce_scatter"
        except (RuntimeError, ValueError):
            # Older gloo has no reduce_scatter: what it would return, via all_reduce.
            t = inp.clone()
            dist.all_reduce(t)
            return (t[self.rank * numel:(self.rank + 1) * numel].clone(),
                    f"all_reduce + own chunk: {self.rt.backend} has no reduce_scatter")

    def barrier(self) -> tuple[bool, str]:
        global _barrier_calls
        _barrier_calls += 1
        store = _default_store()
        t0 = time.perf_counter()
        if store is None:
            _barrier(self.rt)
            return True, "returned on every rank (no store to count arrivals)"
        key = f"disttrain/verify/barrier/{_barrier_calls}"
        store.add(key, 1)
        _barrier(self.rt)
        dt = time.perf_counter() - t0
        seen = int(store.add(key, 0)) - (1 if self.faulty("barrier") else 0)
        if seen != self.n:
            return False, f"left the barrier when {seen} of {self.n} ranks had arrived"
        return True, f"all {self.n} ranks had arrived when it left ({dt * 1e3:.1f} ms)"

    # training ----------------------------------------------------------------------
    def _train(self) -> tuple[str, list[float]]:
        """A short DDP run of the built-in task (run once, shared by two checks)."""
        if self._trained is None:
            self._trained = train_task(self.rt, self.steps, perturb=self.faulty("gradient_sync"),
                                       shuffle_labels=self.faulty("convergence"))
        return self._trained

    def gradient_sync(self) -> tuple[bool, str]:
        digest, _ = self._train()
        hashes = _gather(self.rt, digest)
        ref_rank, ref = _reference(hashes)
        if digest != ref:
            return False, (f"parameters differ from rank {ref_rank}'s after {self.steps} DDP "
                           f"steps (sha256 {digest[:12]}… vs {ref[:12]}…)")
        return True, (f"parameters equal on all {self.n} ranks after {self.steps} DDP steps "
                      f"(sha256 {digest[:12]}…)")

    def convergence(self) -> tuple[bool, str]:
        _, losses = self._train()
        k = max(1, min(5, len(losses) // 4))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        drop = 1 - last / first if first > 0 else 0.0
        text = (f"loss {first:.3f} -> {last:.3f} ({-drop:+.0%}; must fall by "
                f"{CONVERGENCE_MARGIN:.0%} or more)")
        return math.isfinite(last) and drop >= CONVERGENCE_MARGIN, text

    def consistency(self) -> tuple[bool, str]:
        mine = versions(self.rt.backend)
        if self.faulty("consistency"):
            mine["torch"] += "+fault"
        all_versions = _gather(self.rt, mine)
        ref_rank, ref = _reference([json.dumps(v, sort_keys=True) for v in all_versions])
        ref_v = json.loads(ref)
        diffs = [f"{k} {mine[k]} (rank {ref_rank}: {ref_v[k]})" for k in mine if mine[k] != ref_v[k]]
        if diffs:
            return False, "differs: " + "; ".join(diffs)
        return True, ", ".join(f"{k} {v}" for k, v in mine.items()) + f"; same on all {self.n} ranks"


def train_task(rt: RankLike, steps: int, perturb: bool = False,
               shuffle_labels: bool = False) -> tuple[str, list[float]]:
    """DDP on a learnable task (labels of a fixed linear teacher), each rank its own shard;
    returns this rank's parameter hash at the end and its loss per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(max(4096, 64 * rt.world_size), 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(dim=1)
    x, y = x[rt.rank::rt.world_size], y[rt.rank::rt.world_size]
    if shuffle_labels:  # fault: this rank's data no longer matches its labels
        y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(99))]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(0)  # identical initial weights everywhere (DDP would broadcast anyway)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(rt.device)
    kwargs: dict[str, Any] = {}
    if rt.device.type == "cuda":
        kwargs = {"device_ids": [rt.device.index], "output_device": rt.device.index}
    ddp = DDP(model, **kwargs)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    x, y = x.to(rt.device), y.to(rt.device)
    losses: list[float] = []
    batch = 32
    for step in range(steps):
        i = (step * batch) % (len(x) - batch + 1)
        loss = nn.functional.cross_entropy(ddp(x[i:i + batch]), y[i:i + batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if perturb and step == steps // 2:  # fault: a rank's weights drift from the others
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3
    return params_sha256(model), losses


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of the state_dict in order; the same as `disttrain.distributed.sync_check.digest`
    of it (repeated here so this file runs with torch alone)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def versions(backend: str) -> dict[str, str]:
    """The versions that must match on all nodes (a torch, CUDA or NCCL mismatch between
    nodes fails or hangs in the first collective), plus the backend."""
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        nccl = "none"
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda or "none"),
            "nccl": nccl, "backend": backend}


def run_checks(rt: RankLike, *, faults: str | dict[str, set[int]] | None = None,
               steps: int = DEFAULT_STEPS, checks: Sequence[str] = CHECKS) -> list[CheckResult]:
    """Run the checks on this rank and gather every rank's results (call on all ranks).

    Args:
        rt: this rank (a `disttrain.distributed.runtime.Runtime`), inside a live process group.
        faults: test-only fault injection (default: the DISTTRAIN_VERIFY_FAULT variable).
        steps: DDP steps of the gradient-sync / convergence run.
        checks: which checks, in CHECKS order.

    Returns:
        The results of all ranks, by check then rank; the same list on every rank.
    """
    if faults is None or isinstance(faults, str):
        faults = parse_faults(os.environ.get(FAULT_ENV) if faults is None else faults)
    checker = _Checker(rt, faults, steps)
    table: dict[str, Callable[[], tuple[bool, str]]] = {
        name: getattr(checker, name) for name in CHECKS if not name.startswith("all_reduce_")}
    table.update({f"all_reduce_{op}": functools.partial(checker.all_reduce, op)
                  for op in ("sum", "avg", "max")})
    where = {"host": socket.gethostname(), "local_rank": rt.local_rank,
             "device": str(rt.device), "backend": rt.backend}
    mine: list[dict[str, Any]] = []
    raised = None
    for name in (c for c in CHECKS if c in checks):
        t0 = time.perf_counter()
        if raised:
            # After an error (e.g. a peer timed out) the group's state is unknown: more
            # collectives would each wait out the timeout. Skip; the final gather then
            # fails fast or reports, and the launcher names the rank.
            ok, detail = False, f"not run: {raised} raised before"
        else:
            try:
                ok, detail = table[name]()
            except Exception as exc:  # a check that raises has failed; say how
                ok, detail = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                raised = name
        mine.append({"check": name, "rank": rt.rank, "ok": bool(ok), "detail": detail,
                     "time_s": round(time.perf_counter() - t0, 6), **where})
    everyone = [r for rank_results in _gather(rt, mine) for r in rank_results]
    order = {c: i for i, c in enumerate(CHECKS)}
    return sorted((CheckResult(**r) for r in everyone), key=lambda r: (order[r.check], r.rank))


# -- helpers ----------------------------------------------------------------------------
def _compare(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> str | None:
    """None when equal, else where and how the first wrong element differs."""
    if exact:
        wrong = (got != want).reshape(-1)
    else:
        wrong = ~torch.isclose(got, want, rtol=1e-6, atol=0).reshape(-1)
    if not bool(wrong.any()):
        return None
    i = int(wrong.nonzero()[0])
    return (f"element {i} of {got.numel():,} is {got.reshape(-1)[i].item():g}, expected "
            f"{want.reshape(-1)[i].item():g}")


def _gather(rt: RankLike, obj: Any) -> list[Any]:
    if rt.world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def _reference(values: list[str]) -> tuple[int, str]:
    """(rank, value) to compare with: rank 0's, unless more than half agree on another."""
    value, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return values.index(value), value
    return 0, values[0]


def _barrier(rt: RankLike) -> None:
    if rt.backend == "nccl":
        dist.barrier(device_ids=[rt.device.index or 0])
    else:
        dist.barrier()


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def verdict(results: Sequence[CheckResult]) -> dict[str, Any]:
    """The final `--json` object: pass/fail and the failed (check, rank) pairs."""
    failed = [{"check": r.check, "rank": r.rank, "detail": r.detail} for r in results if not r.ok]
    ranks = sorted({r.rank for r in results})
    return {"verdict": "fail" if failed or not results else "pass", "ok": not failed and bool(results),
            "world_size": len(ranks), "checks": len({r.check for r in results}), "failed": failed}


def json_lines(results: Sequence[CheckResult]) -> list[str]:
    """`--json` output: one object per check and rank, then the verdict object."""
    return [json.dumps(r.to_json()) for r in results] + [json.dumps(verdict(results))]


def summary_lines(results: Sequence[CheckResult]) -> list[str]:
    """Plain-text verdict (no rich): one line per failure, then PASS/FAIL."""
    v = verdict(results)
    lines = [f"FAIL {f['check']} on rank {f['rank']}: {f['detail']}" for f in v["failed"]]
    word = "PASS" if v["ok"] else "FAIL"
    lines.append(f"verdict: {word}: {v['checks']} checks on {v['world_size']} ranks, "
                 f"{len(v['failed'])} failed")
    return lines


def _bare_setup(backend: str, timeout_s: float) -> RankLike:
    """The process group set up with torch alone (only where disttrain is not installed)."""
    # NOTE: the same env contract as disttrain.distributed.runtime.setup, for the k8s verify pod whose
    # image may have torch alone; init_process_group reads RANK/WORLD_SIZE/MASTER_* itself.
    # The names are declared in disttrain/envvars.py; spelled out here for the same reason.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        local_n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_n else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return cast(RankLike, SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                          local_rank=local_rank, device=device, backend=backend))


def main(argv: list[str] | None = None) -> int:
    """`python verify_checks.py` under torchrun (the k8s verify pod), or `-m disttrain.verify.runner`."""
    parser = argparse.ArgumentParser(prog="verify_checks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of text")
    args = parser.parse_args(argv)
    try:
        from disttrain.distributed import runtime
    except ImportError:
        rt: Any = _bare_setup(args.backend, args.timeout_s)
        close = dist.destroy_process_group
    else:
        rt = runtime.setup(args.backend, args.timeout_s)
        close = rt.shutdown
    try:
        results = run_checks(rt, steps=args.steps)
    finally:
        close()
    if rt.rank == 0:
        print("\n".join(json_lines(results) if args.json else summary_lines(results)), flush=True)
    return 0 if verdict(results)["ok"] else 1


def exit_without_teardown(code: int) -> None:
    """Flush stdout / stderr and end with `code` without the interpreter's teardown, where a
    finished rank could abort (torch 2.13: docs/resilience.md, "How a process ends")."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):   # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
