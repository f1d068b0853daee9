"""`disttrain bench`: how fast is communication, scaling, and the Trainer itself?

    disttrain bench allreduce --sizes 4K:256M --json --plot allreduce.png
    disttrain bench scaling --max-procs 2
    disttrain bench scaling --example chargpt --steps 200
    disttrain bench overhead --rounds 5
    disttrain bench overhead --rounds 3 --contend 2  # two busy processes on the same cores
    disttrain bench overhead --example chargpt      # a real model: a small GPT
    disttrain bench overhead --task mytask:make_task --task-args '{"hidden": 256}'

Every bench writes results.json, results.jsonl and a PNG to a run directory (default
runs/bench-<kind>-<UTC timestamp>/, or --run-dir) so that runs can be compared over time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from disttrain.bench.contend import contention
from disttrain.cli.options import collect_overrides, fail, load_spec, spec_options

_CTX = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=_CTX)
def bench() -> None:
    """Benchmarks: allreduce bandwidth, scaling over processes, Trainer overhead."""


def _run_dir_option(fn: Any) -> Any:
    return click.option("--run-dir", default=None, type=click.Path(file_okay=False),
                        callback=_usable_run_dir,
                        help="where results go (default runs/bench-<kind>-<timestamp>)")(fn)


def _usable_run_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --run-dir that cannot be created (too long a name, under a file) is bad input."""
    from disttrain.errors import SpecError
    from disttrain.spec.paths import check_writable_dir

    try:
        if value is not None:
            check_writable_dir(value)
    except SpecError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _echo_rows(rows: list[dict[str, Any]]) -> None:
    click.echo("\n".join(json.dumps(r) for r in rows))


@bench.command(context_settings=_CTX)
@click.option("-f", "--file", "spec_file", type=click.Path(dir_okay=False),
              help="job spec YAML: its launch section says how to start the ranks")
@click.option("--sizes", default="4K:256M", show_default=True,
              help="MIN:MAX (powers of two between) or a list 1M,16M,64M; K/M/G are binary")
@click.option("--iters", type=click.IntRange(1), default=20, show_default=True,
              help="timed all-reduces per size")
@click.option("--warmup", type=click.IntRange(0), default=5, show_default=True,
              help="untimed all-reduces per size first")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "float64"]),
              default="float32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per size")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="also write the PNG plot here")
@_run_dir_option
@spec_options(["launch"])
def allreduce(spec_file: str | None, sizes: str, iters: int, warmup: int, dtype: str,
              as_json: bool, plot_file: str | None, run_dir: str | None, **kwargs: Any) -> None:
    """All-reduce bus bandwidth per message size (nccl-tests' algbw / busbw), in place,
    time = slowest rank's mean over --iters after --warmup."""
    from disttrain.bench.common import parse_sizes

    try:
        size_list = parse_sizes(sizes)
    except ValueError as exc:
        fail(f"--sizes: {exc}")
    overrides = collect_overrides(kwargs)
    spec = load_spec(spec_file, overrides)
    if "master_port" in overrides:
        spec.launch.port_explicit = True
    from disttrain.bench.allreduce import plot_allreduce, run_allreduce
    from disttrain.bench.common import new_run_dir, write_results
    from disttrain.errors import BenchError, LaunchError

    try:
        rows = run_allreduce(spec, size_list, iters=iters, warmup=warmup, dtype=dtype)
    except (BenchError, LaunchError) as exc:
        click.echo(f"error: bench allreduce failed: {exc}", err=True)
        raise click.exceptions.Exit(1) from None
    if not rows:
        click.echo("note: global rank 0 runs on another node; its output has the figures")
        return
    out = new_run_dir("allreduce", run_dir)
    settings = {"sizes": sizes, "iters": iters, "warmup": warmup, "dtype": dtype,
                "launch": spec.launch.model_dump(mode="json")}
    write_results(out, "allreduce", settings, rows)
    pngs = [plot_allreduce(rows, out / "allreduce.png")]
    if plot_file:
        pngs.append(plot_allreduce(rows, Path(plot_file)))
    if as_json:
        _echo_rows(rows)
        return
    from rich.console import Console
    from rich.table import Table

    from disttrain.bench.common import format_size

    table = Table(title=f"all_reduce: {rows[0]['backend']}, {rows[0]['world_size']} ranks, "
                  f"{dtype}, in place, {iters} iters after {warmup} warm-up")
    for col in ("size", "bytes", "time µs", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(format_size(r["size_bytes"]), f"{r['size_bytes']:,}", f"{r['time_s'] * 1e6:,.1f}",
                      f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}")
    Console(highlight=False).print(table)
    click.echo(f"results: {out}/results.json, plot: {', '.join(str(p) for p in pngs)}")


def _train_options(rounds: int) -> Any:
    """The options scaling and overhead share (the workload and the repetitions)."""
    return lambda fn: _add_train_options(fn, rounds)


def _add_train_options(fn: Any, rounds: int) -> Any:
    options = [
        click.option("--steps", type=click.IntRange(1), default=300, show_default=True,
                     help="timed optimizer steps per run"),
        click.option("--warmup", type=click.IntRange(0), default=20, show_default=True,
                     help="optimizer steps before the timed window"),
        click.option("--rounds", type=click.IntRange(1), default=rounds, show_default=True,
                     help="interleaved repetitions (medians and min..max are reported)"),
        click.option("--batch-size", type=click.IntRange(1), default=None,
                     help="per process (default: 64 for the SimpleNet workloads, the spec's 32 for "
                     "chargpt and --task)"),
        click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
                     help="torch threads per process"),
        click.option("--num-samples", type=click.IntRange(64), default=None,
                     help="data set size (default: the workload's; 60,000 for synthetic)"),
        click.option("--task", default=None, metavar="MODULE:FUNCTION",
                     help="benchmark your TrainTask instead of an --example (docs/your-model.md)"),
        click.option("--task-args", default=None, metavar="JSON",
                     help="the task function's keyword arguments, a JSON object"),
        click.option("--contend", type=click.IntRange(0, 64), default=0, show_default=True,
                     metavar="N", help="N busy processes on the same cores for the whole benchmark "
                     "(CPU contention, as in a pod on a shared node); stopped at its end"),
        click.option("--json", "as_json", is_flag=True, help="JSON objects instead of a table"),
        _run_dir_option,
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _train_bench(kw: dict[str, Any], example: str | None, overhead: bool,
                 plain_loader: str | None = None) -> Any:
    """The benchmark's workload from the flags; a combination it cannot run exits 2 here,
    before anything is started or written."""
    from disttrain.bench.training import SIMPLENET_PLAIN, TrainBench, check_bench
    from disttrain.errors import SpecError

    if example and kw["task"]:
        fail(f"--task: give --example {example} or --task {kw['task']}, not both")
    if kw["task_args"] is not None and not kw["task"]:
        fail("--task-args: they are a task function's arguments; give --task MODULE:FUNCTION too")
    task_args: dict[str, Any] = {}
    if kw["task_args"] is not None:
        try:
            task_args = json.loads(kw["task_args"])
        except json.JSONDecodeError as exc:
            fail(f"--task-args: not JSON ({exc.msg} at character {exc.pos}); write e.g. "
                 f"'{{\"hidden\": 256}}'")
        if not isinstance(task_args, dict):
            fail(f"--task-args: a JSON object of keyword arguments, not {type(task_args).__name__}")
    workload = "task" if kw["task"] else (example or "synthetic")
    batch = kw["batch_size"] or (64 if workload in (*SIMPLENET_PLAIN, "digits", "seed002") else 32)
    b = TrainBench(workload=workload, task=kw["task"], task_args=task_args, steps=kw["steps"],
                   warmup=kw["warmup"], batch_size=batch, threads=kw["threads"],
                   num_samples=kw["num_samples"])
    try:
        check_bench(b, overhead, plain_loader)
    except SpecError as exc:
        fail(str(exc))
    return b


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _log(as_json: bool) -> Any:
    return (lambda msg: click.echo(msg, err=True)) if as_json else click.echo


@bench.command(context_settings=_CTX)
@click.option("--example", type=click.Choice(["synthetic", "digits", "seed002", "chargpt"]),
              default=None, help="built-in job to train (default synthetic)")
@click.option("--max-procs", type=click.IntRange(1), default=None,
              help="largest process count (default: CPU cores)")
@click.option("--plain/--no-plain", default=True, show_default=True,
              help="run the plain DDP loop beside the Trainer at each count (its efficiency "
              "from the same minutes)")
@_train_options(rounds=3)
def scaling(example: str | None, max_procs: int | None, plain: bool, **kw: Any) -> None:
    """Trainer samples/s at 1..N processes and efficiency = thr(N) / (N x thr(1)), beside
    the plain DDP loop's."""
    from disttrain.bench.common import new_run_dir, write_results
    from disttrain.bench.training import plot_scaling, run_scaling, settings
    from disttrain.errors import BenchError

    b = _train_bench(kw, example, overhead=False)
    script = _plain_beside(b, plain)
    n_max = max_procs or len(os.sched_getaffinity(0))
    out = new_run_dir("scaling", kw["run_dir"])
    try:
        with contention(kw["contend"], limit_s=b.timeout_s * 4 * n_max * kw["rounds"]):
            rows, summary = run_scaling(b, n_max, kw["rounds"], out, log=_log(kw["as_json"]),
                                        plain_script=script)
    except BenchError as exc:
        click.echo(f"error: bench scaling failed: {exc}", err=True)
        raise click.exceptions.Exit(1) from None
    write_results(out, "scaling", settings(b, max_procs=n_max, rounds=kw["rounds"],
                                           contend=kw["contend"],
                                           plain_script=str(script) if script else None),
                  rows, summary)
    png = plot_scaling(summary, out / "scaling.png")
    if kw["as_json"]:
        _echo_rows(summary)
        return
    beside = f"  {'plain':>10}  {'plain eff':>9}  {'plain step':>10}" if script else ""
    click.echo(f"{'procs':>5}  {'samples/s':>10}  {'min..max':>17}  {'efficiency':>10}  "
               f"{'step':>10}{beside}")
    for s in summary:
        plain_cols = (f"  {s['plain_samples_per_s']:>10,.0f}  {s['plain_efficiency']:>9.2f}  "
                      f"{_step(s, 'plain_'):>10}" if script else "")
        click.echo(f"{s['nproc']:>5}  {s['samples_per_s']:>10,.0f}  "
                   f"{s['samples_per_s_min']:>8,.0f}..{s['samples_per_s_max']:<8,.0f}  "
                   f"{s['efficiency']:>10.2f}  {_step(s, ''):>10}{plain_cols}")
    click.echo("step: ms per optimizer step (every process's batch), and what the processes "
               "beyond the first added to it")
    if kw["contend"]:
        click.echo(f"with {kw['contend']} busy process(es) on the same cores")
    click.echo(f"results: {out}/results.json, plot: {png}")


def _step(row: dict[str, Any], prefix: str) -> str:
    """`5.97 +4.03`: a summary row's step time and what it added over 1 process (ms)."""
    step, added = row[prefix + "step_ms"], row[prefix + "added_step_ms"]
    return f"{step:.2f}" if row["nproc"] == 1 else f"{step:.2f} {added:+.2f}"


def _plain_beside(b: Any, plain: bool) -> Path | None:
    """The plain loop that scaling runs beside the Trainer (None: --no-plain, or a built-in
    job that has none: digits and seed002, whose efficiency is then the Trainer's alone)."""
    from disttrain.bench.training import SIMPLENET_PLAIN, find_plain_script
    from disttrain.errors import BenchError

    if not plain or (b.workload not in SIMPLENET_PLAIN and b.task_ref is None):
        return None
    try:
        return find_plain_script(None, b.plain_script_name)
    except BenchError as exc:
        fail(f"{exc}; or give --no-plain")


@bench.command(context_settings=_CTX)
@click.option("--nproc-per-node", "nproc", type=click.IntRange(1), default=2, show_default=True)
@click.option("--example", type=click.Choice(["synthetic", "chargpt"]), default=None,
              help="built-in job to train (default synthetic)")
@click.option("--plain-script", type=click.Path(dir_okay=False), default=None,
              help="the plain DDP loop (default: benchmarks/plain_ddp.py of the checkout, "
              "plain_chargpt.py for chargpt and --task)")
@click.option("--plain-loader", type=click.Choice(["dataloader", "index"]), default=None,
              help="the SimpleNet plain loop's data path: the guide's DataLoader (default), "
              "or batches by index as the Trainer takes them")
@_train_options(rounds=5)
def overhead(nproc: int, example: str | None, plain_script: str | None, plain_loader: str | None,
             **kw: Any) -> None:
    """The Trainer (`disttrain run`) vs a plain hand-written DDP loop (torchrun
    benchmarks/plain_ddp.py, or plain_chargpt.py for a TrainTask) on the same workload,
    interleaved: samples/s ratio, and whether the two loss curves agree."""
    from disttrain.bench.common import new_run_dir, write_results
    from disttrain.bench.training import find_plain_script, plot_overhead, run_overhead, settings
    from disttrain.errors import BenchError

    b = _train_bench(kw, example, overhead=True, plain_loader=plain_loader)
    plain_loader = plain_loader or "dataloader"
    try:
        script = find_plain_script(plain_script, b.plain_script_name)
    except BenchError as exc:
        fail(str(exc))
    out = new_run_dir("overhead", kw["run_dir"])
    try:
        with contention(kw["contend"], limit_s=b.timeout_s * 2 * kw["rounds"]):
            rows, summary = run_overhead(b, script, kw["rounds"], out, nproc=nproc,
                                         loader=plain_loader, log=_log(kw["as_json"]))
        summary["contend"] = kw["contend"]
    except BenchError as exc:
        click.echo(f"error: bench overhead failed: {exc}", err=True)
        raise click.exceptions.Exit(1) from None
    write_results(out, "overhead", settings(b, nproc=nproc, rounds=kw["rounds"],
                                            plain_script=str(script), plain_loader=plain_loader,
                                            contend=kw["contend"]),
                  rows, summary)
    png = plot_overhead(rows, out / "overhead.png")
    if kw["as_json"]:
        _echo_rows([*rows, {"summary": summary}])
        return
    s = summary
    click.echo(f"Trainer / plain DDP samples/s: median {s['ratio_median']:.3f} "
               f"(min {s['ratio_min']:.3f} .. max {s['ratio_max']:.3f}) over {s['rounds']} rounds, "
               f"{nproc} process{'es' if nproc != 1 else ''}"
               + (f", {kw['contend']} busy process(es) beside" if kw["contend"] else ""))
    click.echo(f"medians: Trainer {s['trainer_samples_per_s']:,.0f}, plain "
               f"{s['plain_samples_per_s']:,.0f} samples/s; first step after "
               f"{s['trainer_first_step_s']} s vs {s['plain_first_step_s']} s")
    waits = [r["trainer_comm_wait"] for r in rows if r.get("trainer_comm_wait")]
    if waits:
        click.echo(f"the Trainer's rank 0 waited for its all-reduce by "
                   f"{', '.join(sorted({w.split(':')[0] for w in waits}))} ({waits[-1]})")
    if s["curves_agree"] is not None:
        click.echo(f"loss curves {'agree' if s['curves_agree'] else 'DIFFER'}: final loss Trainer "
                   f"{_num(s['trainer_final_loss'])}, plain {_num(s['plain_final_loss'])}; the later "
                   f"half's mean loss differs by at most {_num(s['curve_late_gap_max'])} over the rounds")
    click.echo(f"results: {out}/results.json, plot: {png}")
