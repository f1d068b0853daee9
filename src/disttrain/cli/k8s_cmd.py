"""`disttrain k8s`: render, apply, status, logs, delete and run-local on K3s + HAMi.

    disttrain k8s render -f job.yaml                 # print the objects (YAML; -o json)
    disttrain k8s render train.py --gpus 2 --gpumem 12000 --image REGISTRY/IMG:TAG
    disttrain k8s apply -f job.yaml [--dry-run]      # idempotent
    disttrain k8s status NAME | logs -f NAME | delete NAME   [-n NAMESPACE]
    sudo disttrain k8s run-local -f job.yaml         # the pods on emulated hosts

Each verb is a thin wrapper: parse, call `disttrain.k8s`, print, exit code. Bad input is
one `error:` line and exit 2 before any cluster is contacted; cluster failures exit 1.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from disttrain.cli.options import SpecFile, fail, job_overrides, load_spec, spec_options

CTX = {"help_option_names": ["-h", "--help"]}
T = TypeVar("T")

# NOTE: verbs owned by other modules, imported only when called. `disttrain k8s verify`
# (the Verify issue) goes here as "verify": "disttrain.cli.k8s_verify_cmd:verify"; it is
# listed once that module exists.
LAZY_VERBS: dict[str, str] = {
    "verify": "disttrain.cli.k8s_verify_cmd:verify",
}


class _K8sGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        extra = [v for v, target in LAZY_VERBS.items() if _importable(target)]
        return [*super().list_commands(ctx), *extra]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_VERBS and _importable(LAZY_VERBS[cmd_name]):
            module, attr = LAZY_VERBS[cmd_name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, cmd_name)


def _importable(target: str) -> bool:
    try:
        return importlib.util.find_spec(target.split(":")[0]) is not None
    except ImportError:
        return False


@click.group("k8s", cls=_K8sGroup, context_settings=CTX)
def k8s() -> None:
    """Kubernetes (K3s + HAMi vGPU): render a job spec to objects, apply and follow it,
    or run its pods locally on emulated hosts. See docs/cluster.md."""


# -- shared pieces -----------------------------------------------------------------------
def _spec_args(fn: Any) -> Any:
    fn = spec_options([None, "launch", "train", "cluster"])(fn)
    fn = click.option("-f", "--file", "spec_file", type=SpecFile(),
                      help="job spec YAML; flags override its fields")(fn)
    fn = click.argument("script_args", nargs=-1, type=click.UNPROCESSED)(fn)
    return click.argument("script", required=False)(fn)


def _cluster_args(fn: Any) -> Any:
    fn = click.option("--context", default=None, help="kubeconfig context")(fn)
    return click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False),
                        help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, "
                             "/etc/rancher/k3s/k3s.yaml)")(fn)


def _job_args(fn: Any) -> Any:
    """NAME, -n/--namespace and the kubeconfig options of a verb on an existing job."""
    fn = _cluster_args(fn)
    fn = click.option("-n", "--namespace", default="default", help="namespace")(fn)
    return click.argument("name")(fn)


def _load(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
          kwargs: dict[str, Any]) -> Any:
    return load_spec(spec_file, job_overrides(script, script_args, kwargs))


def _render(spec: Any, *, local: bool = False) -> Any:
    from disttrain.errors import SpecError
    from disttrain.k8s.render import render

    try:
        rendered = render(spec, Path("."), local=local)
    except SpecError as exc:
        fail(str(exc))
    for warning in rendered.warnings:
        click.echo(f"warning: {warning}", err=True)
    return rendered


def _print_objects(objects: list[dict[str, Any]], output: str) -> None:
    from disttrain.k8s.render import to_json, to_yaml

    click.echo(to_json(objects) if output == "json" else to_yaml(objects), nl=output == "json")


def _connect(kubeconfig: str | None, context: str | None) -> Any:
    from disttrain.errors import KubeError
    from disttrain.k8s.client import Cluster

    try:
        return Cluster.from_kubeconfig(kubeconfig, context)
    except KubeError as exc:
        _cluster_error(exc)


def _cluster_error(exc: Exception) -> NoReturn:
    click.echo(f"error: {exc}", err=True)
    raise click.exceptions.Exit(1)


def _on_cluster(kubeconfig: str | None, context: str | None, call: Callable[[Any], T]) -> T:
    """Connect, then return `call(cluster)`; a KubeError either way is one line, exit 1."""
    from disttrain.errors import KubeError

    cluster = _connect(kubeconfig, context)
    try:
        return call(cluster)
    except KubeError as exc:
        _cluster_error(exc)


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


def _report_failures(failed: list[tuple[str, str, str]]) -> None:
    """(pod, what, log) of each failed pod: say so and pass the log to the doctor."""
    for pod, what, text in failed:
        click.echo(f"error: pod {pod} {what}", err=True)
        finding = _diagnosis(text)
        if finding:
            click.echo(finding, err=True)


# -- verbs -------------------------------------------------------------------------------
@k8s.command(context_settings=CTX)
@_spec_args
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml",
              help="output format")
def render(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
           output: str, **kwargs: Any) -> None:
    """Print the Kubernetes objects for a job (SCRIPT or the built-in job; see --kind)."""
    spec = _load(script, script_args, spec_file, kwargs)
    _print_objects(_render(spec).objects, output)


@k8s.command(context_settings=CTX)
@_spec_args
@_cluster_args
@click.option("--dry-run", is_flag=True, help="print the objects, do not contact the cluster")
def apply(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
          kubeconfig: str | None, context: str | None, dry_run: bool, **kwargs: Any) -> None:
    """Create or update the job's objects (unchanged objects are left alone)."""
    spec = _load(script, script_args, spec_file, kwargs)
    rendered = _render(spec)
    if dry_run:
        _print_objects(rendered.objects, "yaml")
        return
    results = _on_cluster(kubeconfig, context, lambda cluster: cluster.apply(rendered.objects))
    for r in results:
        click.echo(f"{r.ref.kind.lower()}/{r.ref.name} {r.action}")
    click.echo(f"follow it: disttrain k8s logs -f {spec.name} -n {spec.cluster.namespace}")


@k8s.command(context_settings=CTX)
@_job_args
def status(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> None:
    """Show each pod of job NAME: rank, phase, restarts, node, GPU resources, scheduler."""
    st = _on_cluster(kubeconfig, context, lambda cluster: cluster.status(namespace, name))
    for line in st.workloads:
        click.echo(line)
    rows = [("RANK", "POD", "PHASE", "RESTARTS", "NODE", "GPU", "SCHEDULER")]
    rows += [(p.rank, p.name, p.phase + (f" (exit {p.exit_code})" if p.exit_code else ""),
              str(p.restarts), p.node,
              " ".join(f"{k}={v}" for k, v in p.gpu.items()) or "-", p.scheduler)
             for p in st.pods]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for p in st.pods:
        for warning in p.warnings:
            click.echo(f"warning: {warning}", err=True)


@k8s.command(context_settings=CTX)
@click.option("-f", "--follow", is_flag=True, help="stream until the pods end")
@_job_args
def logs(name: str, follow: bool, namespace: str, kubeconfig: str | None,
         context: str | None) -> None:
    """Print the logs of every pod of job NAME, prefixed with rank and pod; a failed pod's
    log goes to the doctor."""
    pod_logs = _on_cluster(kubeconfig, context,
                           lambda cluster: cluster.logs(namespace, name, follow=follow,
                                                        out=click.echo))
    failed = [(p.pod, "failed", p.text) for p in pod_logs if p.failed]
    _report_failures(failed)
    raise click.exceptions.Exit(1 if failed else 0)


@k8s.command(context_settings=CTX)
@_job_args
def delete(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> None:
    """Delete job NAME's workload, Service and ConfigMap (PVCs are kept)."""
    deleted = _on_cluster(kubeconfig, context, lambda cluster: cluster.delete_job(namespace, name))
    for ref in deleted:
        click.echo(f"{ref.kind.lower()}/{ref.name} deleted")


@k8s.command("run-local", context_settings=CTX)
@_spec_args
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="stop the emulated pods after this many seconds")
def run_local(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
              timeout_s: float | None, **kwargs: Any) -> None:
    """Run the rendered pods here, each in its own network namespace (needs root and ip)."""
    from disttrain.errors import LocalRunError, SpecError
    from disttrain.k8s.local import check_host, local_spec
    from disttrain.k8s.local import run_local as run

    spec = _load(script, script_args, spec_file, kwargs)
    try:
        check_host()
    except LocalRunError as exc:
        fail(str(exc))
    _render(local_spec(spec, Path(".")), local=True)  # bad input: exit 2 before any setup
    _clear_run_dir(local_spec(spec, Path(".")))
    try:
        result = run(spec, Path("."), out=click.echo, timeout_s=timeout_s)
    except (LocalRunError, SpecError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        click.echo("interrupted: emulated pods stopped, namespaces removed", err=True)
        raise click.exceptions.Exit(130) from None
    run_dir = local_spec(spec, Path(".")).train.run_dir
    if result.timed_out:
        click.echo(f"error: run-local stopped after --timeout {timeout_s:g}s", err=True)
    _report_failures([(pod, f"failed (exit code {result.exit_codes[pod]})", result.logs[pod])
                      for pod in result.failed])
    if result.exit_code == 0:
        click.echo(f"run-local: all {len(result.exit_codes)} pods succeeded; run dir {run_dir}")
    raise click.exceptions.Exit(result.exit_code)


def _clear_run_dir(spec: Any) -> None:
    """Like `disttrain run`: an earlier run's outputs are replaced unless --resume."""
    import shutil

    from disttrain.cli.run_cmd import RUN_OUTPUTS

    run_dir = Path(spec.train.run_dir)
    if spec.train.resume or not run_dir.exists():
        return
    old = [run_dir / n for n in RUN_OUTPUTS if (run_dir / n).exists()]
    if old:
        click.echo(f"note: {run_dir} holds an earlier run; replacing it "
                   f"(use --resume to continue it instead)", err=True)
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
