#!/usr/bin/env python3
"""`disttrain bench allreduce` beside a raw `dist.all_reduce` loop: the time ratio per size.

    python benchmarks/compare_allreduce.py                      # 1M,16M,64M, 7 rounds, same job
    python benchmarks/compare_allreduce.py --separate --rounds 5   # as two commands

Same job (default): one torchrun job alternates, per size and round, disttrain's
measurement (`disttrain.bench.allreduce.measure`, process group from
`disttrain.distributed.runtime.setup`) and the raw loop of benchmarks/allreduce_raw.py, so both see
the same host load within milliseconds of each other: this checks the measurement.
`--separate`: each round runs `disttrain bench allreduce --json` and `torchrun
allreduce_raw.py` as separate commands, alternating which goes first: this also covers
the launch path, but on a shared machine the host drifts by tens of percent between
commands, so expect a wide min..max.

Printed per size: both times (median over rounds) and the paired ratio disttrain / raw
(median and min..max). They should agree within 10 %; this prints, it does not assert.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain import envvars

HERE = Path(__file__).resolve().parent


def _env() -> dict[str, str]:
    env = {**os.environ, envvars.OMP_NUM_THREADS: "1"}
    env.pop(envvars.T0, None)
    return env


def run(argv: list[str]) -> list[dict]:
    res = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=1800)
    if res.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def worker(args: argparse.Namespace) -> None:
    """Inside torchrun: both measurements, interleaved, one process group."""
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from allreduce_raw import sizes, time_allreduce

    from disttrain.bench.allreduce import measure
    from disttrain.distributed import runtime

    with runtime.setup(args.backend, timeout_s=600, threads=1) as rt:
        for rnd in range(args.rounds):
            for size in sizes(args.sizes):
                order = ["disttrain", "raw"] if rnd % 2 == 0 else ["raw", "disttrain"]
                for who in order:
                    if who == "raw":
                        _, t = time_allreduce(size, args.iters, args.warmup, rt.device)
                    else:
                        t = measure([size], args.iters, args.warmup, "float32", rt)[0]["time_s"]
                    if dist.get_rank() == 0:
                        print(json.dumps({"who": who, "round": rnd, "size_bytes": size,
                                          "time_s": t}), flush=True)


def report(rows: list[dict]) -> None:
    print(f"{'bytes':>12} {'disttrain us':>13} {'raw us':>10} {'ratio med':>9} {'min..max':>13}")
    for size in sorted({r["size_bytes"] for r in rows}):
        by_round = {(r["who"], r["round"]): r["time_s"] for r in rows if r["size_bytes"] == size}
        rounds = sorted({rnd for _, rnd in by_round})
        ours = [by_round[("disttrain", rnd)] for rnd in rounds]
        raw = [by_round[("raw", rnd)] for rnd in rounds]
        ratios = [a / b for a, b in zip(ours, raw)]
        print(f"{size:>12,} {statistics.median(ours) * 1e6:>13,.0f} "
              f"{statistics.median(raw) * 1e6:>10,.0f} {statistics.median(ratios):>9.3f} "
              f"{min(ratios):>6.3f}..{max(ratios):<6.3f}")
    print("ratio = disttrain time / raw time (1.00 = identical; 0.90..1.10 expected)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--separate", action="store_true", help="two commands per round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    common = ["--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.nproc}"]
    if not args.separate:
        report(run([*torchrun, str(Path(__file__).resolve()), "--worker", *common,
                    "--rounds", str(args.rounds), "--backend", args.backend]))
        return
    ours = [sys.executable, "-m", "disttrain.cli.main", "bench", "allreduce", *common, "--json",
            "--nproc-per-node", str(args.nproc), "--backend", args.backend, "--master-port", "0"]
    raw = [*torchrun, str(HERE / "allreduce_raw.py"), *common, "--backend", args.backend]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for who in (["disttrain", "raw"] if rnd % 2 == 0 else ["raw", "disttrain"]):
                argv = [*ours, "--run-dir", f"{tmp}/r{rnd}"] if who == "disttrain" else raw
                rows += [{**r, "who": who, "round": rnd} for r in run(argv)]
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report(rows)


if __name__ == "__main__":
    main()
