"""`disttrain verify`: is the distributed setup correct on this machine (or these nodes)?

    disttrain verify                               # 2 gloo ranks on CPU, one rank per GPU
    disttrain verify --nproc-per-node 4 --backend gloo --json
    disttrain verify --nnodes 2 --node-rank 0 --master-addr 10.0.0.1   # on every node

Exit codes: 0 every check passed on every rank, 1 a check failed (the output names the
check and the rank), 2 bad input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from disttrain.cli.options import collect_overrides, fail, load_spec, spec_options

SHORT = {"consistency": "versions", "all_reduce_sum": "sum", "all_reduce_avg": "avg",
         "all_reduce_max": "max", "broadcast": "bcast", "all_gather": "gather",
         "reduce_scatter": "r-scatter", "barrier": "barrier", "gradient_sync": "grad sync",
         "convergence": "converge", "launch": "launch"}
MAX_RANK_COLUMNS = 8  # beyond this, one row per check with the failed ranks listed


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-f", "--file", "spec_file", type=click.Path(dir_okay=False),
              help="job spec YAML: its launch section says how to start the check")
@click.option("--json", "as_json", is_flag=True,
              help="one JSON object per check and rank, then a verdict object")
@click.option("--steps", type=click.IntRange(10, 100_000), default=None,
              help="DDP steps of the gradient-sync / convergence run (default 100)")
@click.option("--fault", default=None, hidden=True,
              help="TESTING ONLY: <check>:<rank>[,...] breaks that check on that rank")
@spec_options(["launch"])
def verify(spec_file: str | None, as_json: bool, steps: int | None, fault: str | None,
           **kwargs: Any) -> None:
    """Check collectives (all_reduce sum/avg/max, broadcast, all_gather, reduce_scatter,
    barrier), gradient sync and convergence of a short DDP run, and that torch/CUDA/NCCL
    versions match, on every rank. Exit 1 names the failed check and rank."""
    overrides = collect_overrides(kwargs)
    if overrides.get("launcher", "torchrun") == "torchrun" and not spec_file:
        from disttrain.launch.forkserver import prewarm_workers

        prewarm_workers(share_torch=True)  # the workers' server shares our torch import
    spec = load_spec(spec_file, overrides)
    if spec.launch.launcher != "torchrun":
        fail(f"launch.launcher: verify starts its ranks with torchrun's API; "
             f"'{spec.launch.launcher}' is not supported here (drop --launcher)")
    if "master_port" in overrides:
        spec.launch.port_explicit = True
    from disttrain.errors import LaunchError
    from disttrain.verify.runner import DEFAULT_STEPS, json_lines, verify_local

    try:
        results, code = verify_local(spec, fault=fault, steps=steps or DEFAULT_STEPS)
    except (ValueError, LaunchError) as exc:
        fail(str(exc))
    if as_json:
        click.echo("\n".join(json_lines(results)))
    else:
        print_report(results)
    raise click.exceptions.Exit(code)


def print_report(results: Sequence[Any]) -> None:
    """The per-rank table, the per-check table, the failures and the verdict."""
    from rich.console import Console
    from rich.table import Table

    from disttrain.verify.runner import summary_lines

    console = Console(width=max(100, Console().width), highlight=False)
    ranks = sorted({r.rank for r in results})
    checks = list(dict.fromkeys(r.check for r in results))
    by = {(r.check, r.rank): r for r in results}
    ranks_table = Table(title="ranks", title_justify="left")
    for col in ("rank", "host", "local rank", "device", "backend", "checks s"):
        ranks_table.add_column(col, justify="right" if col in ("rank", "checks s") else "left")
    for rank in ranks:
        own = [r for r in results if r.rank == rank]
        first = own[0]
        ranks_table.add_row(str(rank), first.host or "?", str(first.local_rank),
                            first.device or "?", first.backend or "?",
                            f"{sum(r.time_s for r in own):.2f}")
    console.print(ranks_table)
    checks_table = Table(title="checks (time on each rank)", title_justify="left")
    checks_table.add_column("check")
    if len(ranks) <= MAX_RANK_COLUMNS:
        for rank in ranks:
            checks_table.add_column(f"rank {rank}", justify="right")
        for check in checks:
            checks_table.add_row(check, *(_cell(by.get((check, rank))) for rank in ranks))
    else:
        for col in ("ok ranks", "failed ranks", "slowest"):
            checks_table.add_column(col, justify="right")
        for check in checks:
            rows = [r for r in results if r.check == check]
            failed = [str(r.rank) for r in rows if not r.ok]
            checks_table.add_row(check, str(len(rows) - len(failed)), ",".join(failed) or "-",
                                 _ms(max(r.time_s for r in rows)))
    console.print(checks_table)
    for check in checks:  # how each passed check was judged; per rank where it differs
        ok = [r for r in results if r.check == check and r.ok]
        if len(ok) == len(ranks) and len({r.detail for r in ok}) == 1:
            console.print(f"  {SHORT.get(check, check):>9}: {ok[0].detail}")
        else:
            for r in ok:
                console.print(f"  {SHORT.get(check, check):>9} rank {r.rank}: {r.detail}")
    for line in summary_lines(results):
        style = "bold green" if line.startswith("verdict: PASS") else "bold red"
        console.print(line, style=style if line.startswith(("verdict", "FAIL")) else None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _cell(result: Any) -> str:
    if result is None:
        return "-"
    return f"{'ok' if result.ok else 'FAIL'} {_ms(result.time_s)}"
