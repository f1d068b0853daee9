"""`disttrain report`: a finished run in a picture and a table.

    disttrain report runs/main            # writes runs/main/report.png, prints the table
    disttrain report runs/main --json     # the same figures for machines

Exit codes: 0 written, 2 RUN_DIR is not a finished run (one `error:` line naming the
missing file). The work lives in `disttrain.monitor.report`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from disttrain.cli.options import CTX, fail


@click.command(context_settings=CTX)
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def report(run_dir: Path, as_json: bool) -> None:
    """Write RUN_DIR/report.png (loss and samples/s per rank, step-time breakdown per rank)
    and print the summary, the per-rank means and the straggler verdict."""
    from disttrain.errors import RunDirError
    from disttrain.monitor.report import load_report, plot_report, summary_tables

    try:
        rep = load_report(run_dir)
        plot_report(rep)
    except RunDirError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(rep.as_dict(), indent=2))
        return
    from rich.console import Console

    Console().print(summary_tables(rep))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(report())
