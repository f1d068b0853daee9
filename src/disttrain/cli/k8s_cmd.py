"""`disttrain k8s`: render, apply, status, logs, delete and run-local on K3s + HAMi.

    disttrain k8s render -f job.yaml                 # print the objects (YAML; -o json)
    disttrain k8s render train.py --gpus 2 --gpumem 12000 --image REGISTRY/IMG:TAG
    disttrain k8s apply -f job.yaml [--dry-run]      # idempotent
    disttrain k8s status NAME | logs -f NAME | delete NAME   [-n NAMESPACE]
    sudo disttrain k8s run-local -f job.yaml         # the pods on emulated hosts
    disttrain k8s verify -f job.yaml                 # k8s_verify_cmd.py
    disttrain k8s top NAME                           # k8s_top_cmd.py: the live view, from the pods

Each verb is a thin wrapper: parse, call `disttrain.k8s`, print, exit code. Bad input is
one `error:` line and exit 2 before any cluster is contacted; cluster failures exit 1.
The options and helpers the verbs share are in k8s_common.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from disttrain.cli.k8s_common import (
    cluster_args,
    connect,
    job_args,
    load_job,
    no_plan_option,
    on_cluster,
    on_cluster_call,
    render_or_fail,
    spec_args,
)
from disttrain.cli.k8s_top_cmd import top
from disttrain.cli.k8s_verify_cmd import verify
from disttrain.cli.options import CTX, SpecCommand, fail


@click.group("k8s", context_settings=CTX)
def k8s() -> None:
    """Kubernetes (K3s + HAMi vGPU): render a job spec to objects, apply and follow it,
    or run its pods locally on emulated hosts. See docs/cluster.md."""


k8s.add_command(verify)
k8s.add_command(top)


def _print_objects(objects: list[dict[str, Any]], output: str) -> None:
    from disttrain.k8s.render import to_json, to_yaml

    click.echo(to_json(objects) if output == "json" else to_yaml(objects), nl=output == "json")


def _diagnosis(text: str) -> str | None:
    """The doctor's finding for a failed pod's log."""
    try:
        from disttrain.diagnose.logs import diagnose, format_diagnosis
    except ImportError:
        return None
    try:
        return format_diagnosis(diagnose(text))
    except Exception as exc:
        return f"(the doctor could not read this log: {exc})"


def _check_capacity(cluster: Any, spec: Any, force: bool) -> None:
    """Refuse (exit 2) a multi-pod job whose pods cannot all be placed on the free HAMi
    slices now, unless a queue or gang holds them until they can, or --force."""
    from disttrain.k8s.capacity import gang_fit
    from disttrain.k8s.gang import pod_count

    if pod_count(spec) < 2 or spec.cluster.gpus < 1:
        if force:
            fail("--force: it overrides the capacity check of a job with several GPU pods, "
                 "and this job has one pod or no GPUs; drop --force")
        return
    if isinstance(spec.cluster.gpumem, str):  # `auto` the plan did not resolve
        click.echo(f"note: gpumem {spec.cluster.gpumem} is not a number of MiB; the capacity "
                   f"check is skipped", err=True)
        return
    fit = on_cluster_call(cluster, lambda: gang_fit(spec, cluster.list_all("Node"),
                                                    cluster.list_all("Pod")))
    if not fit.free:
        click.echo("note: no node carries HAMi's hami.io/node-nvidia-register annotation; "
                   "the capacity check is skipped", err=True)
    elif fit.fits:
        click.echo(f"capacity: {fit.message}")
    elif spec.cluster.queue or spec.cluster.gang:
        held = f"Kueue queue {spec.cluster.queue}" if spec.cluster.queue else "the PodGroup"
        click.echo(f"note: not all pods fit now ({fit.message}); {held} holds them until "
                   f"they do", err=True)
    elif force:
        click.echo(f"warning: not all pods fit now ({fit.message}); applied anyway (--force)",
                   err=True)
    else:
        fail(f"not all pods of {spec.name} fit now: {fit.message}. The pods that fit would "
             f"start and hold their slices until the rendezvous deadline; wait for room, or "
             f"use --gang coscheduling or --queue NAME (all pods or none), or --force")


def _report_failures(failed: list[tuple[str, str, str]]) -> None:
    """(pod, what, log) of each failed pod: say so and pass the log to the doctor."""
    for pod, what, text in failed:
        click.echo(f"error: pod {pod} {what}", err=True)
        finding = _diagnosis(text)
        if finding:
            click.echo(finding, err=True)


# -- verbs -------------------------------------------------------------------------------
@k8s.command(cls=SpecCommand, context_settings=CTX)
@spec_args
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml",
              help="output format")
@no_plan_option
def render(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
           output: str, no_plan: bool, **kwargs: Any) -> None:
    """Print the Kubernetes objects for a job (SCRIPT or the built-in job; see --kind)."""
    spec = load_job(script, script_args, spec_file, kwargs)
    comments: list[str] = []
    rendered = render_or_fail(spec, plan=not no_plan, comments=comments)
    if output == "yaml":
        for line in comments:
            click.echo(f"# {line}")
    _print_objects(rendered.objects, output)


@k8s.command(cls=SpecCommand, context_settings=CTX)
@spec_args
@cluster_args
@click.option("--dry-run", is_flag=True, help="print the objects, do not contact the cluster")
@click.option("--force", is_flag=True,
              help="apply a multi-pod job even when HAMi's free slices cannot hold all its "
                   "pods now (without --queue or --gang some pods would start and wait)")
@no_plan_option
def apply(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
          kubeconfig: str | None, context: str | None, dry_run: bool, force: bool,
          no_plan: bool, **kwargs: Any) -> None:
    """Create or update the job's objects (unchanged objects are left alone). A multi-pod
    job is first checked against the free HAMi slices (docs/cluster.md, "All pods or none")."""
    spec = load_job(script, script_args, spec_file, kwargs)
    rendered = render_or_fail(spec, plan=not no_plan)
    if dry_run:
        if force:
            fail("--force: it skips the capacity check, which --dry-run does not make")
        _print_objects(rendered.objects, "yaml")
        return
    cluster = connect(kubeconfig, context)
    _check_capacity(cluster, spec, force)
    results = on_cluster_call(cluster, lambda: cluster.apply(rendered.objects))
    for r in results:
        click.echo(f"{r.ref.kind.lower()}/{r.ref.name} {r.action}")
    click.echo(f"follow it: disttrain k8s logs -f {spec.name} -n {spec.cluster.namespace}")


@k8s.command(context_settings=CTX)
@job_args
def status(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> None:
    """Show each pod of job NAME: rank, phase, restarts, node, GPU resources, scheduler."""
    st = on_cluster(kubeconfig, context, lambda cluster: cluster.status(namespace, name))
    for line in st.workloads:
        click.echo(line)
    rows = [("RANK", "POD", "PHASE", "RESTARTS", "NODE", "GPU", "SCHEDULER")]
    # a Pending pod's reason (the scheduler's FailedScheduling message) follows the table
    rows += [(p.rank, p.name, p.phase + (f" (exit {p.exit_code})" if p.exit_code else ""),
              str(p.restarts), p.node,
              " ".join(f"{k}={v}" for k, v in p.gpu.items()) or "-", p.scheduler)
             for p in st.pods]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for p in st.pods:
        if p.pending:
            click.echo(f"pod {p.name}: {p.pending}")
        for warning in p.warnings:
            click.echo(f"warning: {warning}", err=True)
    if st.verdict:
        click.echo(f"rendezvous: {st.verdict}")


@k8s.command(context_settings=CTX)
@click.option("-f", "--follow", is_flag=True, help="stream until the pods end")
@job_args
def logs(name: str, follow: bool, namespace: str, kubeconfig: str | None,
         context: str | None) -> None:
    """Print the logs of every pod of job NAME, prefixed with rank and pod; a failed pod's
    log goes to the doctor."""
    pod_logs = on_cluster(kubeconfig, context,
                           lambda cluster: cluster.logs(namespace, name, follow=follow,
                                                        out=click.echo))
    failed = [(p.pod, "failed", p.text) for p in pod_logs if p.failed]
    _report_failures(failed)
    if failed:  # pods that never started: the rendezvous the failed ones waited in
        verdict = on_cluster(kubeconfig, context,
                             lambda cluster: cluster.status(namespace, name).verdict)
        if verdict:
            click.echo(f"error: {verdict}", err=True)
    raise click.exceptions.Exit(1 if failed else 0)


@k8s.command(context_settings=CTX)
@job_args
def delete(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> None:
    """Delete job NAME's workload, Service, ConfigMap, PodGroup and TrainJob runtime (PVCs
    are kept)."""
    deleted = on_cluster(kubeconfig, context, lambda cluster: cluster.delete_job(namespace, name))
    for ref in deleted:
        click.echo(f"{ref.kind.lower()}/{ref.name} deleted")


@k8s.command("run-local", cls=SpecCommand, context_settings=CTX)
@spec_args
@click.option("--timeout", "run_timeout_s", type=float, default=None,
              help="stop the emulated pods after this many seconds")
@click.option("--unschedulable", "unschedulable", multiple=True, metavar="POD",
              help="emulate a pod the scheduler never places (it never starts): rehearse "
                   "the rendezvous deadline (--rdzv-timeout-s) of a half-started job")
def run_local(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
              run_timeout_s: float | None, unschedulable: tuple[str, ...],
              **kwargs: Any) -> None:
    """Run the rendered pods here, each in its own network namespace (needs root and ip)."""
    from disttrain.errors import LocalRunError, SpecError
    from disttrain.k8s.local import check_host, local_spec
    from disttrain.k8s.local import run_local as run

    spec = load_job(script, script_args, spec_file, kwargs)
    try:
        check_host()
    except LocalRunError as exc:
        fail(str(exc))
    render_or_fail(local_spec(spec, Path(".")), local=True)  # bad input: exit 2 before any setup
    _clear_run_dir(local_spec(spec, Path(".")))
    try:
        result = run(spec, Path("."), out=click.echo, timeout_s=run_timeout_s,
                     **({"unschedulable": unschedulable} if unschedulable else {}))
    except (LocalRunError, SpecError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        click.echo("interrupted: emulated pods stopped, namespaces removed", err=True)
        raise click.exceptions.Exit(130) from None
    run_dir = local_spec(spec, Path(".")).train.run_dir
    if result.timed_out:
        click.echo(f"error: run-local stopped after --timeout {run_timeout_s:g}s", err=True)
    for lost in result.lost.values():  # a host killed as a whole, with its ranks (typed)
        click.echo(lost.outcome.line(lost.message), err=True)
    _report_failures([(pod, f"failed (exit code {result.exit_codes[pod]})", result.logs[pod])
                      for pod in result.failed])
    if result.verdict:  # last: what the failures above come from
        click.echo(f"error: {result.verdict}", err=True)
    if result.exit_code == 0:
        click.echo(f"run-local: all {len(result.exit_codes)} pods succeeded; run dir {run_dir}")
    raise click.exceptions.Exit(result.exit_code)


def _clear_run_dir(spec: Any) -> None:
    """Like `disttrain run`: an earlier run's outputs are replaced unless --resume."""
    from disttrain.errors import SpecError
    from disttrain.rundir import replace_earlier_run
    from disttrain.spec.paths import check_writable_dir

    try:
        run_dir = check_writable_dir(spec.train.run_dir, "train.run_dir: ")
    except SpecError as exc:
        fail(str(exc))
    if spec.train.resume or not run_dir.exists():
        return
    replace_earlier_run(run_dir, note=lambda line: click.echo(line, err=True))
