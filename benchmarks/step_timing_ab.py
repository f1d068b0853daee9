"""What the step-time breakdown costs: the Trainer's step with its StepTimer on vs a no-op
timer, paired in the same 2 gloo processes (docs/performance.md, "What it costs").

    .venv/bin/python benchmarks/step_timing_ab.py --pairs 40

Alternating blocks of 50 synthetic-workload steps (`train_step` + `optimizer_step`, the
interval read every 10 steps as the loop does), the order swapped every pair, so the load
of a shared machine falls on both sides alike; prints the p50 step times and the paired
block ratio (off / on: below 1 means the timer costs time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

from disttrain.testing import run_ranks, setup_for_test

BLOCK = 50


class NoTimer:
    """The StepTimer's interface doing nothing: the Trainer without the breakdown."""

    def start(self) -> None: ...
    def timed(self, batches: Iterable[Any]) -> Iterable[Any]:
        return batches
    def compute_start(self) -> None: ...
    def compute_end(self) -> None: ...
    def optimizer_start(self) -> None: ...
    def optimizer_end(self) -> None: ...
    def interval(self) -> None: ...


def _bench(run_dir: str, pairs: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    from disttrain.spec.job import JobSpec
    from disttrain.train.build import build_trainer
    from disttrain.train.step_timing import StepTimer

    spec = JobSpec.from_dict({"task": "disttrain.examples.synthetic:make_task"},
                             {"batch_size": 64, "epochs": 1000,
                              "checkpoint_every_epochs": 0, "run_dir": run_dir})
    with setup_for_test() as rt:
        trainer = build_trainer(spec, rt)
        on, off = StepTimer(), NoTimer()
        on.attach(rt, trainer.comm)
        hook = trainer.comm.on_last_bucket if trainer.comm else None
        trainer.model.train()

        def batches() -> Iterator[Any]:
            while True:
                trainer.loader.set_epoch(0)
                yield from trainer.loader

        src = batches()
        out: dict[str, list[float]] = {"on": [], "off": []}
        for pair in range(pairs + 1):   # pair 0 warms up
            for mode in (("on", "off") if pair % 2 else ("off", "on")):
                trainer.telemetry.timer = on if mode == "on" else off  # type: ignore[assignment]
                if trainer.comm is not None:
                    trainer.comm.on_last_bucket = hook if mode == "on" else None
                dist.barrier()
                t0 = time.perf_counter()
                timer = trainer.telemetry.timer
                timer.start()
                for i, batch in zip(range(BLOCK), timer.timed(src)):
                    trainer.train_step(batch, 1.0, sync=True)
                    trainer.optimizer_step()
                    if (i + 1) % 10 == 0:
                        timer.interval()
                if pair:
                    out[mode].append((time.perf_counter() - t0) / BLOCK * 1000)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--run-dir", default="runs/step-timing-ab")
    args = ap.parse_args()
    r = run_ranks(2, _bench, args.run_dir, args.pairs, timeout_s=900)[0]
    ratios = [b / a for a, b in zip(r["on"], r["off"])]
    print(json.dumps({"on_ms_p50": round(statistics.median(r["on"]), 3),
                      "off_ms_p50": round(statistics.median(r["off"]), 3),
                      "off_over_on_p50": round(statistics.median(ratios), 3),
                      "min": round(min(ratios), 3), "max": round(max(ratios), 3), "pairs": len(ratios)}))


if __name__ == "__main__":
    main()
