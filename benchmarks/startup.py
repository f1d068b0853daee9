#!/usr/bin/env python3
"""Start-up: time from the command's start to the end of the first optimizer step.

    python benchmarks/startup.py                  # 5 interleaved rounds, 2 processes
    python benchmarks/startup.py --rounds 7 --nproc 2

Compares `disttrain run --example synthetic ...` (the Trainer writes first_step_s into
summary.json, measured from DISTTRAIN_T0 = the `disttrain` process's start read from
/proc) with `torchrun benchmarks/plain_ddp.py` (which reports the same measure from the
torchrun process's start, read from /proc). Both include the interpreter and torch
import of the launcher, worker start, data creation (60,000 x 784 synthetic samples),
process-group set-up and DDP construction. Short runs (a few steps) keep it quick; the
wall time of each command is printed as well. Rounds alternate which command goes first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from disttrain.bench.training import TrainBench, find_plain_script, run_plain, run_trainer

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per run (after 0 warm-up)")
    args = p.parse_args()
    b = TrainBench(steps=args.steps, warmup=0)
    plain = find_plain_script(HERE / "plain_ddp.py")
    got: dict[str, dict[str, list[float]]] = {
        "disttrain run": {"first_step_s": [], "wall_s": []},
        "torchrun plain_ddp.py": {"first_step_s": [], "wall_s": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            names = list(got) if rnd % 2 == 0 else list(got)[::-1]
            for name in names:
                if name == "disttrain run":
                    res = run_trainer(b, args.nproc, Path(tmp) / f"t{rnd}")
                else:
                    res = run_plain(b, args.nproc, plain, Path(tmp) / f"p{rnd}.json")
                got[name]["first_step_s"].append(res["first_step_s"])
                got[name]["wall_s"].append(res["wall_s"])
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{n} {got[n]['first_step_s'][-1]:.2f} s" for n in got), file=sys.stderr)
    print(f"{'command':<24} {'first step s (median, min..max)':>32} {'wall s median':>14}")
    for name, v in got.items():
        f = v["first_step_s"]
        print(f"{name:<24} {statistics.median(f):>13.2f} ({min(f):.2f}..{max(f):.2f}) "
              f"{statistics.median(v['wall_s']):>14.2f}")
    ratio = [a / b for a, b in zip(got["disttrain run"]["first_step_s"],
                                   got["torchrun plain_ddp.py"]["first_step_s"])]
    print(f"paired ratio disttrain / torchrun: median {statistics.median(ratio):.2f} "
          f"({min(ratio):.2f}..{max(ratio):.2f}), {args.nproc} processes")


if __name__ == "__main__":
    main()
