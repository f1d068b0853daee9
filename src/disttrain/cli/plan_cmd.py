"""`disttrain plan`: the job's GPU memory per rank, and the slice to request, before launch.

    disttrain plan -f job.yaml                     # per-rank table, the gpumem to ask for
    disttrain plan --example chargpt --gpumem 2000 # fits? if not, the flags that would
    disttrain plan --task mytask:make_task --json  # {"peak_bytes", "gpumem_mib", "fits", ...}
    disttrain plan --example chargpt --nproc-per-node 2 --pp 2   # each stage; the busiest is the peak

The same arguments as `disttrain run` (and the cluster's gpus/gpumem); nothing is launched,
no process group is made, no weights are allocated (fake tensors: plan/trace.py); a tp
or pp degree is planned on the run's own split (plan/parallel.py), never dropped.
Exit codes: 0 planned (fits or no slice set), 1 does not fit the given slice, 2 bad input
or a job that cannot be planned (one `error:` line).
"""

from __future__ import annotations

import json
from typing import Any

import click

from disttrain.cli.options import CTX, SpecCommand, SpecFile, fail, job_overrides, load_spec, spec_options


@click.command(cls=SpecCommand, context_settings=CTX)
@click.option("-f", "--file", "spec_file", type=SpecFile(),
              help="job spec YAML; flags override its fields")
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
@spec_options([None, "launch", "train", "cluster"])
def plan(spec_file: str | None, as_json: bool, **kwargs: Any) -> None:
    """Plan the job's GPU memory per rank (parameters, gradients, optimizer state,
    activations, temporaries, the peak and where), the HAMi slice (gpumem) to request,
    and, when it does not fit the slice given, the cheapest flags that would."""
    spec = load_spec(spec_file, job_overrides(None, (), kwargs))
    if spec.task and hasattr(spec, "task_dir"):
        from pathlib import Path

        base = Path(spec_file).resolve().parent if spec_file else Path.cwd()
        spec.task_dir = str((base / spec.task_dir).resolve() if spec.task_dir else base)
    result = plan_or_fail(spec)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        from disttrain.plan.text import format_plan

        click.echo(format_plan(result))
    raise click.exceptions.Exit(1 if result.fits is False else 0)


def plan_or_fail(spec: Any, search: bool = True) -> Any:
    """`plan_job(spec)`, with a job that cannot be planned as one line and exit 2."""
    from disttrain.errors import DisttrainError
    from disttrain.plan.slice import too_small

    gpumem = spec.cluster.gpumem
    if isinstance(gpumem, int) and too_small(gpumem):
        fail(too_small(gpumem))
    try:
        from disttrain.plan import plan_job
        from disttrain.plan.mesh_fit import check_mesh_fits

        check_mesh_fits(spec)   # tp divides the heads, pp <= the blocks
        return plan_job(spec, search=search)
    except DisttrainError as exc:
        fail(str(exc))
    except Exception as exc:   # a model or step the fake trace cannot run
        fail(f"the job could not be traced on fake tensors ({type(exc).__name__}: "
             f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); set cluster.gpumem "
             f"yourself, or pass --no-plan to render/apply")
