"""`disttrain k8s verify`: `disttrain verify`'s checks as a job on the cluster, with a verdict.

    disttrain k8s verify -f job.yaml          # where the job would run: image, GPUs, HAMi, NCCL
    disttrain k8s verify -f job.yaml --json --keep

The check job is `disttrain.verify.runner.verify_job_spec(spec)`: the job's cluster settings,
`disttrain/verify/verify_checks.py` (torch only) shipped in the ConfigMap, named `<name>-verify`.
Exit codes: 0 all checks passed, 1 a check failed or the cluster refused, 2 bad input.
"""

from __future__ import annotations

from typing import Any

import click

from disttrain.cli.k8s_common import cluster_args, load_job, on_cluster, render_or_fail, spec_args
from disttrain.cli.options import CTX


@click.command(context_settings=CTX)
@spec_args
@cluster_args
@click.option("--json", "as_json", is_flag=True,
              help="one JSON object per check and rank, then the verdict (pod logs on stderr)")
@click.option("--keep", is_flag=True, help="leave the finished check job on the cluster")
@click.option("--steps", type=click.IntRange(10, 100_000), default=None,
              help="DDP steps of the gradient-sync / convergence run (default 100)")
def verify(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
           kubeconfig: str | None, context: str | None, as_json: bool, keep: bool,
           steps: int | None, **kwargs: Any) -> None:
    """Run the verify checks as a job where the spec's job would run; print the verdict."""
    from disttrain.cli.verify_cmd import print_report
    from disttrain.verify.runner import DEFAULT_STEPS, json_lines, verify_job_spec, verify_on_cluster

    spec = load_job(script, script_args, spec_file, kwargs)
    render_or_fail(verify_job_spec(spec))  # bad input: exit 2 before the cluster is contacted
    results, code = on_cluster(kubeconfig, context, lambda cluster: verify_on_cluster(
        spec, cluster, out=lambda line: click.echo(line, err=as_json), keep=keep,
        steps=steps or DEFAULT_STEPS))
    if as_json:
        click.echo("\n".join(json_lines(results)))
    else:
        print_report(results)
    raise click.exceptions.Exit(code)
