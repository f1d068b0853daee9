"""Training throughput: scaling over processes, and the Trainer against a plain DDP loop.

    rows, summary = run_scaling(TrainBench(), max_procs=2, rounds=3, out_dir=run_dir)
    rows, summary = run_overhead(TrainBench(), plain_script, rounds=5, out_dir=run_dir)

Both sides are started as a user starts them, as separate commands: the Trainer through
`disttrain run --example synthetic --lr-scaling none ...`, the reference through
`torchrun benchmarks/plain_ddp.py` (the hand-written DDP loop a user would start from).
Both measure the same way (docs/performance.md): `warmup` optimizer steps, then samples_per_s =
global samples of the next `steps` steps / their duration on rank 0; first_step_s =
start of the command's process -> end of the first optimizer step. For the Trainer the
window is read back from rank 0's metrics.jsonl records, which carry the samples/s of
every `log_every_steps` interval (the log interval divides `warmup` and `steps`, so the
window is exactly steps warmup+1 .. warmup+steps). Rounds are interleaved, alternating
which side goes first, because this shared machine drifts by tens of percent between
runs: compare paired ratios and their min..max, not single figures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.bench.common import pyplot, save_figure, spread
from disttrain.errors import BenchError
from disttrain.spec.paths import file_problem


@dataclass(frozen=True)
class TrainBench:
    """The benchmark workload (docs/performance.md): SimpleNet 784-512-10 on synthetic data,
    Adam lr 1e-3, batch 64 per process, one thread per process, gloo."""

    workload: str = "synthetic"
    steps: int = 300
    warmup: int = 20
    batch_size: int = 64
    threads: int = 1
    num_samples: int | None = None  # data set size (default: the workload's, 60,000)
    timeout_s: float = 600.0

    @property
    def log_every(self) -> int:
        return math.gcd(self.warmup, self.steps)


def _env(threads: int) -> dict[str, str]:
    env = {**os.environ, envvars.OMP_NUM_THREADS: str(threads), envvars.PYTHONUNBUFFERED: "1"}
    env.pop(envvars.T0, None)  # the child command marks its own start
    return env


def _run(argv: list[str], threads: int, timeout_s: float) -> float:
    t0 = time.perf_counter()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, env=_env(threads),
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{' '.join(argv[:6])} ... did not finish in {timeout_s:g} s") from None
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-15:]
        raise BenchError(f"{' '.join(argv)} exited with {res.returncode}:\n" + "\n".join(tail))
    return time.perf_counter() - t0


def trainer_argv(b: TrainBench, nproc: int, run_dir: Path) -> list[str]:
    """`disttrain run` of the benchmark workload (the Trainer, as users launch it)."""
    argv = [sys.executable, "-m", "disttrain.cli.main", "run", "--example", b.workload,
            "--nproc-per-node", str(nproc), "--batch-size", str(b.batch_size),
            "--lr", "0.001", "--lr-scaling", "none", "--optimizer", "adam",
            "--epochs", "100000", "--max-steps", str(b.warmup + b.steps),
            "--log-every-steps", str(b.log_every), "--checkpoint-every-epochs", "0",
            "--threads", str(b.threads), "--master-port", "0", "--run-dir", str(run_dir)]
    if b.num_samples:
        argv += ["--num-samples", str(b.num_samples)]
    return argv


def run_trainer(b: TrainBench, nproc: int, run_dir: Path) -> dict[str, Any]:
    """One `disttrain run`; its window throughput and start-up from the run directory."""
    wall = _run(trainer_argv(b, nproc, run_dir), b.threads, b.timeout_s)
    summary = json.loads((run_dir / "summary.json").read_text())
    sps = window_throughput(run_dir / "metrics.jsonl", b.warmup, b.steps, summary["global_batch"])
    return {"samples_per_s": sps, "first_step_s": summary.get("first_step_s"), "wall_s": wall,
            "final_loss": summary.get("final_loss"), "params_in_sync": summary.get("params_in_sync"),
            "world_size": summary.get("world_size")}


def window_throughput(metrics: Path, warmup: int, steps: int, global_batch: int) -> float:
    """Global samples/s over optimizer steps warmup+1 .. warmup+steps, from rank 0's records.

    Each record's samples_per_s covers the steps since the previous record; the window's
    duration is the sum of those intervals (samples / rate), as one clock on rank 0.
    """
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    logged = sorted({(r["step"], r["samples_per_s"]) for r in rows
                     if r.get("split") == "train" and r.get("rank") == 0})
    prev, seconds, samples = warmup, 0.0, 0
    for step, rate in logged:
        if step <= warmup or step > warmup + steps:
            continue
        n = (step - prev) * global_batch
        seconds += n / rate
        samples += n
        prev = step
    if prev != warmup + steps or not seconds:
        raise BenchError(f"{metrics}: no records up to step {warmup + steps}; was the run cut short?")
    return samples / seconds


def plain_argv(b: TrainBench, nproc: int, script: Path, out: Path, loader: str) -> list[str]:
    """`torchrun benchmarks/plain_ddp.py` with the same workload and window."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(script), "--steps", str(b.steps),
            "--warmup", str(b.warmup), "--batch-size", str(b.batch_size),
            "--threads", str(b.threads), "--loader", loader, "--out", str(out)]
    if b.num_samples:
        argv += ["--num-samples", str(b.num_samples)]
    return argv


def run_plain(b: TrainBench, nproc: int, script: Path, out: Path,
              loader: str = "dataloader") -> dict[str, Any]:
    """One `torchrun plain_ddp.py`; the figures it wrote to `out`."""
    wall = _run(plain_argv(b, nproc, script, out, loader), b.threads, b.timeout_s)
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    return res


def find_plain_script(given: str | Path | None = None) -> Path:
    """benchmarks/plain_ddp.py of the source checkout (or `given`).

    Raises:
        BenchError: not found (an installed disttrain has no benchmarks/ folder).
    """
    candidates = [Path(given)] if given else [
        Path(__file__).resolve().parents[3] / "benchmarks" / "plain_ddp.py",
        Path.cwd() / "benchmarks" / "plain_ddp.py"]
    for path in candidates:
        if file_problem(path) is None:  # not is_file(): no OSError on a too-long name
            return path
    raise BenchError(f"plain DDP reference {candidates[0]} not found; run from a disttrain "
                     f"source checkout or pass --plain-script PATH")


# -- the two benchmarks -------------------------------------------------------------
def run_scaling(b: TrainBench, max_procs: int, rounds: int, out_dir: Path,
                log: Any = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trainer samples/s at 1..max_procs processes; efficiency = thr(n) / (n thr(1)).

    Returns (one row per run, one summary row per process count).
    """
    rows: list[dict[str, Any]] = []
    for rnd in range(rounds):
        order = list(range(1, max_procs + 1))
        for n in order if rnd % 2 == 0 else order[::-1]:
            res = run_trainer(b, n, out_dir / f"runs/n{n}-r{rnd}")
            rows.append({"round": rnd, "nproc": n, **res})
            if log:
                log(f"round {rnd + 1}/{rounds}: {n} proc: {res['samples_per_s']:,.0f} samples/s")
    base = {r["round"]: r["samples_per_s"] for r in rows if r["nproc"] == 1}
    summary = []
    for n in range(1, max_procs + 1):
        mine = [r for r in rows if r["nproc"] == n]
        s = spread([r["samples_per_s"] for r in mine])
        paired = spread([r["samples_per_s"] / (n * base[r["round"]]) for r in mine])
        summary.append({"nproc": n, "workload": b.workload, "samples_per_s": s["median"],
                        "samples_per_s_min": s["min"], "samples_per_s_max": s["max"],
                        "efficiency": s["median"] / (n * spread(list(base.values()))["median"]),
                        "efficiency_min": paired["min"], "efficiency_max": paired["max"],
                        "rounds": len(mine)})
    return rows, summary


def run_overhead(b: TrainBench, plain_script: Path, rounds: int, out_dir: Path, nproc: int = 2,
                 loader: str = "dataloader", log: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Trainer vs plain DDP loop, interleaved; ratio = Trainer samples/s / plain samples/s.

    Returns (one row per round, summary: ratio median/min/max and both sides' medians).
    """
    rows: list[dict[str, Any]] = []
    for rnd in range(rounds):
        sides = ["trainer", "plain"] if rnd % 2 == 0 else ["plain", "trainer"]
        got: dict[str, dict[str, Any]] = {}
        for side in sides:
            if side == "trainer":
                got[side] = run_trainer(b, nproc, out_dir / f"runs/trainer-r{rnd}")
            else:
                got[side] = run_plain(b, nproc, plain_script, out_dir / f"runs/plain-r{rnd}.json", loader)
        t, p = got["trainer"], got["plain"]
        row = {"round": rnd, "first": sides[0], "ratio": t["samples_per_s"] / p["samples_per_s"],
               "trainer_samples_per_s": t["samples_per_s"], "plain_samples_per_s": p["samples_per_s"],
               "trainer_first_step_s": t["first_step_s"], "plain_first_step_s": p["first_step_s"],
               "trainer_params_in_sync": t["params_in_sync"], "plain_params_in_sync": p["params_in_sync"],
               "trainer_final_loss": t["final_loss"], "plain_final_loss": p["final_loss"]}
        rows.append(row)
        if log:
            log(f"round {rnd + 1}/{rounds}: trainer {t['samples_per_s']:,.0f} / plain "
                f"{p['samples_per_s']:,.0f} samples/s = {row['ratio']:.3f}")
    ratio = spread([r["ratio"] for r in rows])
    summary = {"ratio_median": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"],
               "rounds": rounds, "nproc": nproc, "plain_loader": loader}
    for key in ("trainer_samples_per_s", "plain_samples_per_s", "trainer_first_step_s",
                "plain_first_step_s"):
        values = [r[key] for r in rows if r[key] is not None]
        summary[key] = spread(values)["median"] if values else None
    return rows, summary


def settings(b: TrainBench, **extra: Any) -> dict[str, Any]:
    return {**asdict(b), "log_every_steps": b.log_every, **extra}


def plot_scaling(summary: list[dict[str, Any]], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    n = [s["nproc"] for s in summary]
    thr = [s["samples_per_s"] for s in summary]
    ax.plot(n, thr, marker="o", label="measured (median)")
    ax.fill_between(n, [s["samples_per_s_min"] for s in summary],
                    [s["samples_per_s_max"] for s in summary], alpha=0.2, label="min..max")
    ax.plot(n, [k * thr[0] for k in n], linestyle="--", color="grey", label="ideal n x thr(1)")
    for s in summary:
        ax.annotate(f"eff {s['efficiency']:.2f}", (s["nproc"], s["samples_per_s"]),
                    textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xticks(n)
    ax.set_xlabel("processes")
    ax.set_ylabel("samples/s (global)")
    ax.set_title(f"scaling: {summary[0]['workload']}" if summary else "scaling")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out)


def plot_overhead(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    x = [r["round"] + 1 for r in rows]
    ax.bar([i - 0.2 for i in x], [r["trainer_samples_per_s"] for r in rows], 0.4, label="Trainer")
    ax.bar([i + 0.2 for i in x], [r["plain_samples_per_s"] for r in rows], 0.4, label="plain DDP")
    for r in rows:
        ax.annotate(f"{r['ratio']:.2f}", (r["round"] + 1, max(r["trainer_samples_per_s"],
                    r["plain_samples_per_s"])), ha="center", textcoords="offset points",
                    xytext=(0, 3), fontsize=8)
    ax.set_xticks(x)
    ax.set_xlabel("round")
    ax.set_ylabel("samples/s (global)")
    ax.set_title("Trainer vs plain DDP loop (ratio above)")
    ax.legend()
    return save_figure(fig, out)
