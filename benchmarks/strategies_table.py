#!/usr/bin/env python3
"""Samples/s and gradient bytes per step of DDP comm hooks and gradient accumulation.

    python benchmarks/strategies_table.py                      # 3 rounds, writes the table
    python benchmarks/strategies_table.py --rounds 5 --steps 300 --out /tmp/table.md
    python benchmarks/strategies_table.py --ablation       # 1 process: what each default buys
    python benchmarks/strategies_table.py --paired         # Trainer vs plain DDP, same processes

The synthetic workload of docs/performance.md (SimpleNet 784-512-10,
batch 64 per process, Adam lr 1e-3, gloo, 2 processes, 1 thread each), run as users run
it: `disttrain run --example synthetic --comm-hook H --grad-accum K`. Rows: hooks
none / fp16 / bf16 / powersgd at K=1, and K=4 without a hook. samples/s is the
benchmark window (optimizer steps warmup+1 .. warmup+steps on rank 0, from
metrics.jsonl); bytes and all-reduces per optimizer step are what the comm hook's counter
measured (summary.json). Rounds are interleaved and rotate the order, because this
shared machine drifts by tens of percent between runs: read the paired ratio to the
`none, K=1` row of the same round, and the min..max.

`--ablation` times the 1-process training step in this process, adding the Trainer's
defaults one at a time to the plain loop (DataLoader, DDP with world size 1, for-loop Adam,
zero_grad()), variants interleaved block by block so host drift hits all alike. The
allocator is pinned (process.tune_allocator) for all of them: it cannot be undone within
a process, and docs/performance.md gives its effect, measured separately.

`--paired` runs the Trainer's own step (`build_trainer` + `train_step` + `optimizer_step`)
and a plain DDP loop (DataLoader, DDP(model), Adam, zero_grad()) in the same 1 and 2
processes, alternating blocks of 50 steps behind a barrier: both sides see the same
host load, which on this shared 2-vCPU machine swings throughput by 2x between runs.
Reported per side: the median over blocks of samples/s, the paired ratio per block
pair, and efficiency = Trainer sps(2) / (2 x Trainer sps(1)).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from disttrain import envvars

CONFIGS = [("none", 1), ("fp16", 1), ("bf16", 1), ("powersgd", 1), ("none", 4)]


def run_one(hook: str, k: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One `disttrain run` of the workload; the window's samples/s and the summary."""
    log_every = math.gcd(args.warmup, args.steps)
    argv = [sys.executable, "-m", "disttrain.cli.main", "run", "--example", "synthetic",
            "--nproc-per-node", "2", "--batch-size", "64", "--lr", "0.001",
            "--lr-scaling", "none", "--optimizer", "adam", "--epochs", "100000",
            "--max-steps", str(args.warmup + args.steps), "--log-every-steps", str(log_every),
            "--checkpoint-every-epochs", "0", "--threads", "1", "--master-port", "0",
            "--comm-hook", hook, "--grad-accum", str(k), "--run-dir", str(run_dir)]
    env = {**os.environ, envvars.OMP_NUM_THREADS: "1"}
    env.pop(envvars.T0, None)
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": window_sps(run_dir / "metrics.jsonl", args.warmup, args.steps,
                                        summary["global_batch"]), **summary}


def window_sps(metrics: Path, warmup: int, steps: int, global_batch: int) -> float:
    """Global samples/s over optimizer steps warmup+1 .. warmup+steps (rank 0's clock)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    logged = sorted({(r["step"], r["samples_per_s"]) for r in rows
                     if r.get("split") == "train" and r.get("rank") == 0})
    prev, seconds, samples = warmup, 0.0, 0
    for step, rate in logged:
        if warmup < step <= warmup + steps:
            n = (step - prev) * global_batch
            seconds, samples, prev = seconds + n / rate, samples + n, step
    if prev != warmup + steps:
        raise SystemExit(f"{metrics}: records stop before step {warmup + steps}")
    return samples / seconds


def table(results: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    """Markdown: one row per configuration, medians over rounds and the paired ratio."""
    base = results[("none", 1)]
    lines = [
        "| comm hook | K | samples/s median (min..max) | ratio to none,K=1 (paired) | "
        "all-reduce bytes / opt. step | all-reduces / step | bytes / 1k samples | "
        "final loss | test acc |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (hook, k), runs in results.items():
        sps = [r["samples_per_s"] for r in runs]
        ratios = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(runs, base)]
        last = runs[-1]
        per_k = last["allreduce_bytes_per_step"] / last["global_batch"] * 1000
        lines.append(
            f"| {hook} | {k} | {statistics.median(sps):,.0f} ({min(sps):,.0f}..{max(sps):,.0f}) | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) | "
            f"{last['allreduce_bytes_per_step']:,} | {last['allreduce_calls_per_step']} | "
            f"{per_k:,.0f} | {statistics.median(r['final_loss'] for r in runs):.3f} | "
            f"{statistics.median(r['test_accuracy'] for r in runs):.3f} |")
    return "\n".join(lines)


ABLATION = ("plain DDP loop (DataLoader, DDP, Adam)", "+ batches by index", "+ fused Adam",
            "+ no DDP wrapper at world size 1 (= Trainer)")


def ablation(blocks: int, block_steps: int) -> str:
    """Median step ms of each cumulative variant at world size 1 (see module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from disttrain.distributed.process import tune_allocator
    from disttrain.examples.datasets import load_synthetic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    data = load_synthetic()
    ds = TensorDataset(data.train_x, data.train_y)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)

    def make(level: int) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        net: nn.Module = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        if level < 3:
            net = DDP(net)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True if level >= 2 else None)
        if level == 0:
            batches = iter(DataLoader(ds, batch_size=64, sampler=sampler))
        else:
            order = torch.tensor(list(sampler))
            batches = ((data.train_x[order[i:i + 64]], data.train_y[order[i:i + 64]])
                       for i in range(0, len(order) - 64, 64))
        return net, opt, batches

    tune_allocator()
    variants = [make(level) for level in range(len(ABLATION))]
    times: list[list[float]] = [[] for _ in ABLATION]
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(blocks):
        for level, (net, opt, batches) in enumerate(variants):
            for _ in range(block_steps):
                t0 = time.perf_counter()
                x, y = next(batches)
                loss_fn(net(x), y).backward()
                opt.step()
                opt.zero_grad()
                times[level].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    base = statistics.median(times[0])
    lines = ["| variant (cumulative) | step ms p50 | step ms mean | samples/s (p50) | x plain |",
             "|---|---:|---:|---:|---:|"]
    for name, ts in zip(ABLATION, times):
        p50 = statistics.median(ts)
        lines.append(f"| {name} | {p50 * 1e3:.2f} | {statistics.fmean(ts) * 1e3:.2f} | "
                     f"{64 / p50:,.0f} | {base / p50:.2f} |")
    return "\n".join(lines)


def _paired_rank(blocks: int, block_steps: int) -> dict[str, list[float]]:
    """One rank of --paired: block times of the plain loop and of the Trainer's step."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from disttrain.spec.job import JobSpec
    from disttrain.testing import setup_for_test
    from disttrain.train.build import build_trainer

    with setup_for_test() as rt, tempfile.TemporaryDirectory() as tmp:
        spec = JobSpec.from_dict({}, {
            "example": "synthetic", "batch_size": 64, "lr": 0.001, "lr_scaling": "none",
            "checkpoint_every_epochs": 0, "threads": 1, "run_dir": tmp})
        trainer = build_trainer(spec, rt)
        trainer.model.train()
        ds = TensorDataset(trainer.loader.x, trainer.loader.y)
        sampler = DistributedSampler(ds, num_replicas=rt.world_size, rank=rt.rank, seed=0)
        torch.manual_seed(0)
        plain = DDP(nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10)))
        plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()

        def forever(loader_factory: Any) -> Any:
            epoch = 0
            while True:
                yield from loader_factory(epoch)
                epoch += 1

        def plain_epoch(epoch: int) -> Any:
            sampler.set_epoch(epoch)
            return DataLoader(ds, batch_size=64, sampler=sampler)

        def trainer_epoch(epoch: int) -> Any:
            trainer.loader.set_epoch(epoch)
            return iter(trainer.loader)

        plain_batches, trainer_batches = forever(plain_epoch), forever(trainer_epoch)
        out: dict[str, list[float]] = {"plain": [], "trainer": []}
        for b in range(blocks + 1):          # block 0 of each side is warm-up
            for side in (("plain", "trainer") if b % 2 else ("trainer", "plain")):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(block_steps):
                    if side == "plain":
                        x, y = next(plain_batches)
                        plain_opt.zero_grad()
                        loss_fn(plain(x), y).backward()
                        plain_opt.step()
                    else:
                        x, y = next(trainer_batches)
                        trainer.train_step((x, y), 1.0, sync=True)
                        trainer.optimizer_step()
                if b:
                    out[side].append(time.perf_counter() - t0)
        return out


def paired(blocks: int, block_steps: int) -> str:
    from disttrain.testing import run_ranks

    rows, sps_trainer = [], {}
    for n in (1, 2):
        res = run_ranks(n, _paired_rank, blocks, block_steps, timeout_s=600)[0]
        rate = {side: [block_steps * 64 * n / t for t in ts] for side, ts in res.items()}
        ratios = [t / p for t, p in zip(rate["trainer"], rate["plain"])]
        sps_trainer[n] = statistics.median(rate["trainer"])
        rows.append(f"| {n} | {statistics.median(rate['plain']):,.0f} | {sps_trainer[n]:,.0f} | "
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |")
    eff = sps_trainer[2] / (2 * sps_trainer[1])
    return "\n".join(["| processes | plain DDP samples/s | Trainer samples/s | ratio (paired blocks) |",
                      "|---:|---:|---:|---:|", *rows, "",
                      f"Trainer scaling efficiency sps(2) / (2 sps(1)) = {eff:.2f}; "
                      f"{blocks} blocks of {block_steps} steps per side"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=20, help="optimizer steps before the window")
    p.add_argument("--out", default=str(Path(__file__).with_name("strategies_table.md")),
                   help="markdown file for the table ('-' = stdout only)")
    p.add_argument("--ablation", action="store_true",
                   help="time the 1-process step with the Trainer's defaults added one by one")
    p.add_argument("--paired", action="store_true",
                   help="Trainer step vs plain DDP loop in the same processes, 1 and 2 of them")
    args = p.parse_args()
    if args.paired:
        print(paired(blocks=10, block_steps=50))
        return 0
    if args.ablation:
        print(ablation(blocks=8, block_steps=50))
        return 0
    results: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="strategies-table-") as tmp:
        for rnd in range(args.rounds):
            shift = rnd % len(CONFIGS)
            for hook, k in CONFIGS[shift:] + CONFIGS[:shift]:
                r = run_one(hook, k, args, Path(tmp) / f"{hook}-k{k}-r{rnd}")
                results[(hook, k)].append(r)
                print(f"round {rnd + 1}/{args.rounds} {hook:8s} K={k}: "
                      f"{r['samples_per_s']:,.0f} samples/s, "
                      f"{r['allreduce_bytes_per_step']:,} B/step", flush=True)
    text = table(results)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    note = (f"\n\n{args.rounds} rounds, {args.warmup} + {args.steps} optimizer steps per run, "
            f"started {started}, load average at the end {load:.2f}. Generated by "
            f"`python benchmarks/strategies_table.py --rounds {args.rounds}`.\n")
    print(text + note)
    if args.out != "-":
        Path(args.out).write_text("# DDP comm hooks and gradient accumulation, 2 processes\n\n"
                                  + text + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
