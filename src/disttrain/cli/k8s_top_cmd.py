"""`disttrain k8s top`: `disttrain top` for a job on the cluster, read from its pods.

    disttrain k8s top mnist-ddp [-n NAMESPACE] [--once]
    disttrain k8s top mnist-ddp --run-dir /data/runs/mnist-ddp

The pods' live files are read through the API server's exec (`disttrain.monitor.pods`;
your user needs `pods/exec` in the namespace); the view is `disttrain.monitor.top`'s.
Exit codes: 0 the job ended (or --once drew its frame), 1 the cluster refused or every
rank went silent for --stale seconds, 2 no pod had a live file within --timeout.
"""

from __future__ import annotations

import click

from disttrain.cli.k8s_common import connect, job_args
from disttrain.cli.options import CTX, fail


@click.command("top", context_settings=CTX)
@job_args
@click.option("--run-dir", default=None,
              help="the run dir inside the pods (default: the job spec's, runs/NAME)")
@click.option("--once", is_flag=True, help="draw one frame and exit")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="seconds between frames")
@click.option("--timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="seconds to wait for the first live file before giving up (exit 2)")
@click.option("--stale", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="end the view when no rank has written for this many seconds (exit 1)")
def top(name: str, namespace: str, kubeconfig: str | None, context: str | None,
        run_dir: str | None, once: bool, interval: float, timeout: float, stale: float) -> None:
    """Per rank of job NAME: samples/s, loss, the step-time breakdown, the age of its last
    write; the straggler in red (docs/monitoring.md)."""
    from pathlib import Path

    from rich.console import Console

    from disttrain.cli.k8s_common import cluster_error
    from disttrain.errors import KubeError, RunDirError
    from disttrain.monitor.pods import pod_reader
    from disttrain.monitor.top import watch

    cluster = connect(kubeconfig, context)
    try:
        reader = pod_reader(cluster, namespace, name, run_dir)
        code = watch(Path(f"{namespace}/{name}"), Console(), once=once, interval_s=interval,
                     start_timeout_s=timeout, stale_s=stale, read=reader)
    except RunDirError as exc:
        fail(str(exc))
    except KubeError as exc:
        cluster_error(exc)
    raise click.exceptions.Exit(code)
