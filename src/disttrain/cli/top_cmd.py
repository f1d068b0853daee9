"""`disttrain top`: watch a running job's ranks, live, from its run directory.

    disttrain top runs/main                 # refresh until the job ends
    disttrain top runs/main --once          # one frame, for scripts
    disttrain top /mnt/pvc/runs/job --timeout 120

Exit codes: 0 the job ended (or --once drew its frame), 1 every rank stopped writing for
--stale seconds without finishing, 2 no rank wrote a live file within --timeout (one
`error:` line saying where it looked). The view lives in `disttrain.monitor.top`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from disttrain.cli.options import CTX, fail


@click.command(context_settings=CTX)
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--once", is_flag=True, help="draw one frame and exit")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="seconds between frames")
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="seconds to wait for the first live file before giving up (exit 2)")
@click.option("--stale", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="end the view when no rank has written for this many seconds (exit 1)")
def top(run_dir: Path, once: bool, interval: float, timeout: float, stale: float) -> None:
    """Per rank: samples/s, loss, the step-time breakdown, the age of its last write; the
    straggler in red. Reads RUN_DIR/live/ (docs/monitoring.md)."""
    from rich.console import Console

    from disttrain.errors import RunDirError
    from disttrain.monitor.top import watch

    try:
        code = watch(run_dir, Console(), once=once, interval_s=interval,
                     start_timeout_s=timeout, stale_s=stale)
    except RunDirError as exc:
        fail(str(exc))
    raise click.exceptions.Exit(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(top())
