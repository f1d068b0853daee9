"""`disttrain env`: a copy-pasteable report of the environment, for bug reports.

    disttrain env [--gpus] [--json]

Always exit 0: the report describes, it does not judge (`disttrain doctor` judges). What
it collects lives in `disttrain.diagnose.envreport`; this module only prints it.
"""

from __future__ import annotations

import json
import sys

import click

from disttrain.cli.options import CTX


@click.command(context_settings=CTX)
@click.option("--gpus", is_flag=True, help="per-GPU memory, utilization, processes, NVLink")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def env(gpus: bool, as_json: bool) -> None:
    """Print a copy-pasteable report: versions, devices, distributed env vars, HAMi limits."""
    from disttrain.diagnose.envreport import collect, format_report

    report = collect(gpus=gpus)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(format_report(report))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(env())
