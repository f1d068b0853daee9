#!/usr/bin/env python3
"""A raw `dist.all_reduce` timing loop, the yardstick for `disttrain bench allreduce`.

    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce_raw.py --sizes 4K:256M
    python benchmarks/compare_allreduce.py        # both, interleaved, ratio per size

Nothing but torch: init_process_group from torchrun's environment, then per size
`--warmup` untimed and `--iters` timed in-place all-reduces of float32 zeros; time =
slowest rank's mean (all_reduce MAX), algbw = bytes / time, busbw = algbw x 2(n-1)/n
(nccl-tests). Rank 0 prints one JSON line per size with the fields of
`disttrain bench allreduce --json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def sizes(text: str) -> list[int]:
    def one(s: str) -> int:
        s = s.strip().upper().rstrip("B").rstrip("I")
        unit = s[-1] if s and s[-1] in UNITS else ""
        return int(s[:-1] if unit else s) * UNITS[unit]

    if ":" in text:
        lo, hi = (one(p) for p in text.split(":"))
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out
    return [one(p) for p in text.split(",")]


def time_allreduce(size: int, iters: int, warmup: int, device: torch.device) -> tuple[int, float]:
    """(bytes, slowest rank's mean seconds) of `iters` in-place float32 all-reduces."""
    t = torch.zeros(max(1, size // 4), device=device)
    for _ in range(warmup):
        dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    mean = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return t.numel() * 4, mean.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K:256M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    n = dist.get_world_size()
    for size in sizes(args.sizes):
        nbytes, time_s = time_allreduce(size, args.iters, args.warmup, device)
        algbw = nbytes / time_s / 1e9
        if dist.get_rank() == 0:
            print(json.dumps({"size_bytes": nbytes, "time_s": time_s, "algbw_GBps": algbw,
                              "busbw_GBps": algbw * 2 * (n - 1) / n, "world_size": n,
                              "backend": args.backend}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
