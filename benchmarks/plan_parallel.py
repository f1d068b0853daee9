"""Per-rank parameter + optimizer memory of chargpt under ddp, fsdp, tp=2 and pp=2, from the
memory plan and measured on a real 2-rank gloo run, and the samples/s of each (issue 26,
"Must show"). A measurement, not a test: it prints a Markdown table (docs/performance.md).

    .venv/bin/python benchmarks/plan_parallel.py [--batch 16] [--steps 30]

The plan side is `disttrain.plan.tracing.trace_memory` (fake tensors, this process); the real
side one `run_ranks(2, ...)` launch that builds each job with the run's own
`build_trainer`, tracks two optimizer steps (`disttrain.plan.measured.measure_rank`), then
times `--steps` more. pp: rank r runs stage r; the plan's figures for that stage.
samples/s on a shared 2-core CPU machine says how the modes compare here, not on GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES: dict[str, tuple[str, dict[str, Any]]] = {   # name -> (strategy, parallelism)
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "tp=2": ("ddp", {"tp": 2}),
    "pp=2 (1f1b, 4 mb)": ("ddp", {"pp": 2}),
}
MIB = 2**20


def _real(batch: int, steps: int, root: str) -> dict[str, Any]:
    from disttrain.plan.measured import measure_rank
    from disttrain.spec.job import JobSpec
    from disttrain.testing import setup_for_test

    warnings.filterwarnings("ignore")
    out = {}
    with setup_for_test() as rt:
        for i, (name, (strategy, par)) in enumerate(MODES.items()):
            spec = JobSpec.from_dict({
                "task": "disttrain.examples.chargpt:make_task", "parallelism": par,
                "train": {"strategy": strategy, "batch_size": batch, "epochs": 1,
                          "checkpoint_every_epochs": 0, "run_dir": f"{root}/{i}"}})
            out[name] = measure_rank(spec, rt, timed_steps=steps)
    return out


def _planned(batch: int) -> dict[str, list[dict[str, int]]]:
    from disttrain.examples.chargpt import make_task
    from disttrain.plan.trace import Knobs
    from disttrain.plan.tracing import trace_memory

    out = {}
    for name, (strategy, par) in MODES.items():
        p = trace_memory(make_task(), Knobs(strategy=strategy, world_size=2, local_world_size=2,
                                            batch_size=batch, **par))
        out[name] = p.stages or [{"peak_bytes": p.peak_bytes, **p.largest}] * 2
    return out


def main() -> None:
    import tempfile

    from disttrain.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16, help="per-process batch")
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps per mode")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    planned = _planned(args.batch)
    with tempfile.TemporaryDirectory() as root:
        real = run_ranks(2, _real, args.batch, args.steps, root, timeout_s=600)
    print(f"chargpt (3 blocks, width 96, 4 heads), batch {args.batch}/process, fp32, Adam, "
          f"2 gloo ranks; {time.perf_counter() - t0:.0f} s\n")
    print("| mode | rank | params + optimizer, plan | measured | tensor peak, plan | measured "
          "| samples/s |")
    print("|---|---|---|---|---|---|---|")
    for name in MODES:
        for rank in (0, 1):
            p, r = planned[name][rank], real[rank][name]
            sps = f"{r['samples_per_s']:,.0f}" if rank == 0 else ""
            stage = f" (stage {r['stage']})" if r["stage"] is not None else ""
            print(f"| {name} | {rank}{stage} "
                  f"| {(p['parameters'] + p['optimizer']) / MIB:.2f} MiB "
                  f"| {(r['param_bytes'] + r['optimizer_bytes']) / MIB:.2f} MiB "
                  f"| {p['peak_bytes'] / MIB:.2f} MiB | {r['tensor_peak_bytes'] / MIB:.2f} MiB "
                  f"| {sps} |")


if __name__ == "__main__":
    main()
