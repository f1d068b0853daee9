"""All-reduce bandwidth with nccl-tests' definitions, on the job's backend and ranks.

    rows = run_allreduce(spec, parse_sizes("4K:256M"), iters=20, warmup=5)
    disttrain bench allreduce --sizes 4K:256M --json --plot allreduce.png

Per size (nccl-tests `all_reduce_perf -b 4K -e 256M -f 2 -n 20 -w 5`): `warmup` untimed
in-place all-reduces, then `iters` timed ones back to back; a rank's time is the mean
over the timed ones, and the reported time is the slowest rank's (an all-reduce MAX of
the per-rank means: a collective ends when its last rank does).
algbw = bytes / time; busbw = algbw x 2(n-1)/n, the bandwidth each rank's link must
carry in a ring, comparable with the hardware's peak whatever the rank count
(nccl-tests' doc/PERFORMANCE.md). GB are 10^9 bytes, as in nccl-tests.
`benchmarks/compare_allreduce.py` runs this beside a raw `dist.all_reduce` loop
(`benchmarks/allreduce_raw.py`) and prints the ratio per size.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from disttrain.bench.common import format_size, pyplot, save_figure
from disttrain.errors import BenchError
from disttrain.launch.launchers import launch_function
from disttrain.spec.job import JobSpec

FIELDS = ("size_bytes", "time_s", "algbw_GBps", "busbw_GBps", "world_size", "backend")
DTYPES = ("float32", "float16", "bfloat16", "float64")


def busbw_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    return 2 * (world_size - 1) / world_size


def measure(sizes: list[int], iters: int, warmup: int, dtype_name: str, rt: Any) -> list[dict[str, Any]]:
    """The timed loop, on every rank of a live process group; rows for all sizes."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    cuda = rt.device.type == "cuda"
    rows = []
    for size in sizes:
        # zeros: in-place sums stay zero, so repeated iterations never overflow to inf
        t = torch.zeros(max(1, size // elem), dtype=dtype, device=rt.device)
        for _ in range(warmup):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        rt.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        mean = (time.perf_counter() - t0) / iters
        slowest = torch.tensor([mean], dtype=torch.float64, device=rt.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        nbytes = t.numel() * elem
        time_s = float(slowest.item())
        algbw = nbytes / time_s / 1e9
        rows.append({"size_bytes": nbytes, "time_s": time_s, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * busbw_factor(rt.world_size),
                     "world_size": rt.world_size, "backend": rt.backend})
        del t
    return rows


def worker(opts: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One rank: set up with disttrain.distributed.runtime, measure; rank 0 returns the rows."""
    from disttrain.distributed import runtime

    with runtime.setup(opts["backend"], opts["timeout_s"], threads=opts.get("threads")) as rt:
        rows = measure(opts["sizes"], opts["iters"], opts["warmup"], opts["dtype"], rt)
        return rows if rt.is_rank0 else None


def run_allreduce(spec: JobSpec, sizes: list[int], iters: int = 20, warmup: int = 5,
                  dtype: str = "float32") -> list[dict[str, Any]]:
    """Launch the measurement on the spec's ranks; one row per size (FIELDS).

    Raises:
        BenchError: a rank failed.
    """
    opts = {"sizes": sizes, "iters": iters, "warmup": warmup, "dtype": dtype,
            "backend": spec.launch.backend, "timeout_s": spec.launch.timeout_s,
            "threads": spec.train.threads}
    outcome = launch_function(spec, worker, opts)
    if outcome.failures:
        raise BenchError("; ".join(f"rank {r}: {f.summary()}" for r, f in sorted(outcome.failures.items())))
    rows = next((v for v in outcome.values.values() if v), None)
    if rows is None:  # multi-node: global rank 0 lives on another node
        return []
    return rows


def plot_allreduce(rows: list[dict[str, Any]], out: Path) -> Path:
    """busbw and algbw against message size (log scale)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    sizes = [r["size_bytes"] for r in rows]
    ax.plot(sizes, [r["busbw_GBps"] for r in rows], marker="o", label="busbw")
    ax.plot(sizes, [r["algbw_GBps"] for r in rows], marker=".", linestyle="--", label="algbw")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45, fontsize=7)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    if rows:
        ax.set_title(f"all_reduce, {rows[0]['backend']}, {rows[0]['world_size']} ranks")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out)
