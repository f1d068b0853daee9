"""Training throughput: scaling over processes, and the Trainer against a plain DDP loop.

    rows, summary = run_scaling(TrainBench(), max_procs=2, rounds=3, out_dir=run_dir)
    rows, summary = run_overhead(TrainBench(), plain_script, rounds=5, out_dir=run_dir)
    b = TrainBench(workload="chargpt", batch_size=32)          # a real model (a TrainTask)
    b = TrainBench(workload="task", task="mytask:make_task")   # the user's own

Both sides are started as a user starts them, as separate commands: the Trainer through
`disttrain run --example synthetic --lr-scaling none ...` (or `--task REF`), the reference
through `torchrun benchmarks/plain_ddp.py` (SimpleNet) or `benchmarks/plain_chargpt.py`
(chargpt, or any task's model, data and loss): the hand-written DDP loop a user would
start from. Both write their loss every `log_every` steps (averaged over ranks), so a
round also says whether the two loss curves agree (`compare_curves`).
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
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.bench.common import pyplot, save_figure, spread
from disttrain.errors import BenchError, SpecError
from disttrain.spec.paths import file_problem


@dataclass(frozen=True)
class TrainBench:
    """The benchmark workload (docs/performance.md): SimpleNet 784-512-10 on synthetic data,
    Adam lr 1e-3, batch 64 per process, one thread per process, gloo."""

    workload: str = "synthetic"     # a built-in example, or "task" (then `task` is the reference)
    task: str | None = None
    task_args: dict[str, Any] = field(default_factory=dict)
    steps: int = 300
    warmup: int = 20
    batch_size: int = 64
    threads: int = 1
    num_samples: int | None = None  # data set size (default: the workload's, 60,000)
    timeout_s: float = 600.0

    @property
    def log_every(self) -> int:
        return math.gcd(self.warmup, self.steps)

    @property
    def plain_script_name(self) -> str:
        """The plain loop of this workload: SimpleNet's, or the one that trains any task."""
        return "plain_ddp.py" if self.workload in SIMPLENET_PLAIN else "plain_chargpt.py"

    @property
    def task_ref(self) -> str | None:
        """The TrainTask the plain loop trains (None: the SimpleNet workloads)."""
        if self.workload == "task":
            return self.task
        return TASK_EXAMPLES.get(self.workload)


# The workloads benchmarks/plain_ddp.py reproduces (SimpleNet on synthetic data), and the
# built-in examples that are TrainTasks (benchmarks/plain_chargpt.py trains any TrainTask).
SIMPLENET_PLAIN = ("synthetic",)
TASK_EXAMPLES = {"chargpt": "disttrain.examples.chargpt:make_task"}


def check_bench(b: TrainBench, overhead: bool, plain_loader: str | None = None) -> None:
    """The combinations a benchmark cannot run, named before anything starts.

    Raises:
        SpecError: no plain loop for the workload, a task with flags it does not take, or a
            task reference that does not import (resolved, not called).
    """
    if b.workload == "task":
        if not b.task:
            raise SpecError("--task: give the task's module:function (e.g. mytask:make_task)")
        from disttrain.train.task import resolve_factory

        resolve_factory(b.task, [Path.cwd()])  # TaskError (a SpecError) names what was searched
    elif b.task or b.task_args:
        raise SpecError(f"--task-args: they are a task's arguments; give --task REF instead of "
                        f"--example {b.workload}, or drop --task-args")
    if b.num_samples and b.task_ref is not None:
        raise SpecError(f"--num-samples: sets the size of the SimpleNet data sets (synthetic, seed002), "
                        f"not of {b.task or b.workload}; size a task with --task-args")
    if not overhead:
        return
    if b.workload not in SIMPLENET_PLAIN and b.task_ref is None:
        raise SpecError(f"--example {b.workload}: bench overhead has a plain loop for synthetic, "
                        f"chargpt and --task REF only; use one of them")
    if plain_loader == "index" and b.task_ref is not None:
        raise SpecError("--plain-loader index: only the SimpleNet loop (plain_ddp.py) has it; the task's "
                        "plain loop reads its Dataset through a DataLoader, as the Trainer does")


def _env(threads: int, tmpdir: str | None = None) -> dict[str, str]:
    env = {**os.environ, envvars.OMP_NUM_THREADS: str(threads), envvars.PYTHONUNBUFFERED: "1"}
    env.pop(envvars.T0, None)  # the child command marks its own start
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    return env


def _run(argv: list[str], threads: int, timeout_s: float, tmpdir: str | None = None) -> float:
    t0 = time.perf_counter()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, env=_env(threads, tmpdir),
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{' '.join(argv[:6])} ... did not finish in {timeout_s:g} s") from None
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-15:]
        raise BenchError(f"{' '.join(argv)} exited with {res.returncode}:\n" + "\n".join(tail))
    return time.perf_counter() - t0


def trainer_argv(b: TrainBench, nproc: int, run_dir: Path) -> list[str]:
    """`disttrain run` of the benchmark workload (the Trainer, as users launch it)."""
    workload = ["--task", b.task or ""] if b.workload == "task" else ["--example", b.workload]
    if b.task_args:
        workload += ["--task-args", json.dumps(b.task_args)]
    argv = [sys.executable, "-m", "disttrain.cli.main", "run", *workload,
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
    evaluated = summary.get("eval")
    return {"samples_per_s": sps, "first_step_s": summary.get("first_step_s"), "wall_s": wall,
            "final_loss": summary.get("final_loss"), "params_in_sync": summary.get("params_in_sync"),
            "world_size": summary.get("world_size"), "comm_wait": summary.get("comm_wait"),
            "eval_loss": evaluated.get("loss") if isinstance(evaluated, dict) else None,
            "loss_curve": train_curve(run_dir / "metrics.jsonl")}


def train_curve(metrics: Path) -> list[list[float]]:
    """[step, loss averaged over ranks] of every logged training step, from metrics.jsonl."""
    by_step: dict[int, list[float]] = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("split") == "train" and r.get("loss") is not None:
            by_step.setdefault(int(r["step"]), []).append(float(r["loss"]))
    return [[step, sum(v) / len(v)] for step, v in sorted(by_step.items())]


def compare_curves(trainer: list[list[float]], plain: list[list[float]], warmup: int,
                   tolerance: float = 0.02) -> dict[str, Any]:
    """Do two loss curves agree? Compared over the steps both logged after `warmup`.

    The two sides draw the same batches in the same order from the same initial weights,
    but their float rounding differs (fused Adam, bucketed all-reduce), so single points
    drift apart like two noisy runs: what must agree is the level the curve reaches. They
    agree when the mean loss over the later half of the common steps differs by at most
    `tolerance` (relative to the plain loop's). `max_gap` is the largest single-point gap.
    """
    t, p = dict(map(tuple, trainer)), dict(map(tuple, plain))
    common = sorted(s for s in t.keys() & p.keys() if s > warmup)
    if not common:
        return {"points": 0, "agree": None, "late_gap": None, "max_gap": None}
    late = common[len(common) // 2:]
    t_late = sum(t[s] for s in late) / len(late)
    p_late = sum(p[s] for s in late) / len(late)
    gap = t_late - p_late
    return {"points": len(common), "late_trainer": t_late, "late_plain": p_late, "late_gap": gap,
            "max_gap": max(abs(t[s] - p[s]) for s in common),
            "agree": abs(gap) <= tolerance * abs(p_late)}


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
    """`torchrun benchmarks/plain_ddp.py` (or plain_chargpt.py) with the same workload,
    window, learning rate and optimizer as `trainer_argv`."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(script), "--steps", str(b.steps),
            "--warmup", str(b.warmup), "--batch-size", str(b.batch_size),
            "--threads", str(b.threads), "--log-every", str(b.log_every), "--out", str(out)]
    if b.task_ref is not None:
        argv += ["--task", b.task_ref, "--task-args", json.dumps(b.task_args),
                 "--lr", "0.001", "--optimizer", "adam"]
    else:
        argv += ["--loader", loader]
    if b.num_samples:
        argv += ["--num-samples", str(b.num_samples)]
    return argv


def run_plain(b: TrainBench, nproc: int, script: Path, out: Path,
              loader: str = "dataloader") -> dict[str, Any]:
    """One `torchrun plain_ddp.py`; the figures it wrote to `out`. Its TMPDIR is a folder
    removed afterwards: plain torchrun leaves a torchelastic_* folder there per launch."""
    with tempfile.TemporaryDirectory(prefix="disttrain-bench-") as tmp:
        wall = _run(plain_argv(b, nproc, script, out, loader), b.threads, b.timeout_s, tmp)
    res = json.loads(out.read_text())
    res["wall_s"] = wall
    return res


def find_plain_script(given: str | Path | None = None, name: str = "plain_ddp.py") -> Path:
    """benchmarks/<name> of the source checkout (or `given`).

    Raises:
        BenchError: not found (an installed disttrain has no benchmarks/ folder).
    """
    candidates = [Path(given)] if given else [
        Path(__file__).resolve().parents[3] / "benchmarks" / name,
        Path.cwd() / "benchmarks" / name]
    for path in candidates:
        if file_problem(path) is None:  # not is_file(): no OSError on a too-long name
            return path
    raise BenchError(f"plain DDP reference {candidates[0]} not found; run from a disttrain "
                     f"source checkout or pass --plain-script PATH")


# -- the two benchmarks -------------------------------------------------------------
def run_scaling(b: TrainBench, max_procs: int, rounds: int, out_dir: Path, log: Any = None,
                plain_script: Path | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trainer samples/s at 1..max_procs processes; efficiency = thr(n) / (n thr(1)).

    With `plain_script`, the plain loop runs beside it at each process count, interleaved
    (its side first in odd rounds), so that both efficiencies come from the same minutes.

    Returns (one row per run, one summary row per process count).
    """
    rows: list[dict[str, Any]] = []
    sides = ["trainer", "plain"] if plain_script is not None else ["trainer"]
    for rnd in range(rounds):
        order = list(range(1, max_procs + 1))
        for n in order if rnd % 2 == 0 else order[::-1]:
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                if side == "trainer":
                    res = run_trainer(b, n, out_dir / f"runs/n{n}-r{rnd}")
                else:
                    assert plain_script is not None
                    res = run_plain(b, n, plain_script, out_dir / f"runs/plain-n{n}-r{rnd}.json")
                rows.append({"round": rnd, "nproc": n, "side": side, **res})
                if log:
                    log(f"round {rnd + 1}/{rounds}: {n} proc: {side} "
                        f"{res['samples_per_s']:,.0f} samples/s")
    summary = [{"nproc": n, "workload": b.task or b.workload} for n in range(1, max_procs + 1)]
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        prefix = "" if side == "trainer" else "plain_"
        for row in summary:
            row.update({prefix + k: v for k, v in _efficiency(mine, row["nproc"], b.batch_size).items()})
    return rows, summary


def _efficiency(rows: list[dict[str, Any]], n: int, batch_size: int) -> dict[str, Any]:
    """Median samples/s at n processes and efficiency against 1 process (paired min..max).

    Also the step time, step_ms = n x batch / samples/s (one optimizer step of every
    process), and `added_step_ms`, what going from 1 to n processes added to it (medians).
    Efficiency divides by a loop's own 1-process speed, so a loop with a faster single
    process scores lower for the same added time: the added time is what the second
    process costs, comparable between two loops (docs/performance.md, "What the second
    process adds").
    """
    base = {r["round"]: r["samples_per_s"] for r in rows if r["nproc"] == 1}
    mine = [r for r in rows if r["nproc"] == n]
    s = spread([r["samples_per_s"] for r in mine])
    paired = spread([r["samples_per_s"] / (n * base[r["round"]]) for r in mine])
    base_median = spread(list(base.values()))["median"]
    step_ms = 1e3 * n * batch_size / s["median"]
    return {"samples_per_s": s["median"], "samples_per_s_min": s["min"], "samples_per_s_max": s["max"],
            "efficiency": s["median"] / (n * base_median),
            "efficiency_min": paired["min"], "efficiency_max": paired["max"],
            "step_ms": step_ms, "added_step_ms": step_ms - 1e3 * batch_size / base_median,
            "rounds": len(mine)}


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
        curves = compare_curves(t.get("loss_curve") or [], p.get("loss_curve") or [], b.warmup)
        row = {"round": rnd, "first": sides[0], "ratio": t["samples_per_s"] / p["samples_per_s"],
               "trainer_samples_per_s": t["samples_per_s"], "plain_samples_per_s": p["samples_per_s"],
               "trainer_first_step_s": t["first_step_s"], "plain_first_step_s": p["first_step_s"],
               "trainer_params_in_sync": t["params_in_sync"], "plain_params_in_sync": p["params_in_sync"],
               "trainer_comm_wait": t.get("comm_wait"),
               "trainer_final_loss": t["final_loss"], "plain_final_loss": p["final_loss"],
               "trainer_eval_loss": t.get("eval_loss"), "plain_eval_loss": p.get("eval_loss"),
               "curves_agree": curves["agree"], "curve_late_gap": curves["late_gap"],
               "curve_max_gap": curves["max_gap"], "curve_points": curves["points"]}
        rows.append(row)
        if log:
            log(f"round {rnd + 1}/{rounds}: trainer {t['samples_per_s']:,.0f} / plain "
                f"{p['samples_per_s']:,.0f} samples/s = {row['ratio']:.3f}")
    ratio = spread([r["ratio"] for r in rows])
    agree = [r["curves_agree"] for r in rows if r["curves_agree"] is not None]
    summary = {"ratio_median": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"],
               "rounds": rounds, "nproc": nproc, "workload": b.task or b.workload,
               "plain_loader": loader if b.task_ref is None else "dataloader",
               "curves_agree": all(agree) if agree else None,
               "curve_late_gap_max": max((abs(r["curve_late_gap"]) for r in rows
                                          if r["curve_late_gap"] is not None), default=None)}
    for key in ("trainer_samples_per_s", "plain_samples_per_s", "trainer_first_step_s",
                "plain_first_step_s", "trainer_final_loss", "plain_final_loss"):
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
