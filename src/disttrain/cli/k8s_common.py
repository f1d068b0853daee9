"""What the `disttrain k8s ...` verbs share: their options, spec loading, rendering, and
the cluster connection with its one-line errors.

    @k8s.command(context_settings=CTX)
    @spec_args
    @cluster_args
    def apply(script, script_args, spec_file, kubeconfig, context, **kwargs): ...

Kept apart from k8s_cmd.py so that a verb in another module (k8s_verify_cmd.py) uses
public names instead of importing another verb module's private helpers. Exit codes:
bad input is one `error:` line and exit 2 before any cluster is contacted; a cluster that
refuses or cannot be reached is one `error:` line and exit 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from disttrain.cli.options import SpecFile, fail, job_overrides, load_spec, spec_options

T = TypeVar("T")


def spec_args(fn: Any) -> Any:
    """SCRIPT [ARGS...], -f/--file and one flag per launch/train/cluster spec field."""
    fn = spec_options([None, "launch", "train", "cluster"])(fn)
    fn = click.option("-f", "--file", "spec_file", type=SpecFile(),
                      help="job spec YAML; flags override its fields")(fn)
    fn = click.argument("script_args", nargs=-1, type=click.UNPROCESSED)(fn)
    return click.argument("script", required=False)(fn)


def cluster_args(fn: Any) -> Any:
    """--kubeconfig and --context: which cluster to talk to."""
    fn = click.option("--context", default=None, help="kubeconfig context")(fn)
    return click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False),
                        help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, "
                             "/etc/rancher/k3s/k3s.yaml)")(fn)


def job_args(fn: Any) -> Any:
    """NAME, -n/--namespace and the kubeconfig options of a verb on an existing job."""
    fn = cluster_args(fn)
    fn = click.option("-n", "--namespace", default="default", help="namespace")(fn)
    return click.argument("name")(fn)


def load_job(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
             kwargs: dict[str, Any]) -> Any:
    """The JobSpec of `spec_args`' options (the flags the user gave override the file).

    A task's module is read from the spec file's folder (a `task_dir` the file gives is
    relative to it), else the current folder, as `disttrain run` does; the rendered pods get
    the code mount instead."""
    spec = load_spec(spec_file, job_overrides(script, script_args, kwargs))
    if spec.task:
        base = Path(spec_file).resolve().parent if spec_file else Path.cwd()
        spec.task_dir = str((base / spec.task_dir).resolve() if spec.task_dir else base)
    return spec


def no_plan_option(fn: Any) -> Any:
    """--no-plan: render/apply without the memory plan's slice check (docs/memory.md)."""
    return click.option("--no-plan", is_flag=True,
                        help="skip the memory plan: the gpumem slice is not checked (and "
                             "gpumem auto cannot be resolved)")(fn)


def check_slice_or_fail(spec: Any, plan: bool, comments: list[str] | None = None) -> None:
    """The memory plan's slice check (`disttrain.plan.gate`): a refusal is exit 2 with one
    line before anything is rendered or applied; `gpumem: auto` becomes the planned MiB."""
    from disttrain.plan.gate import check_slice

    verdict = check_slice(spec, plan=plan)
    if verdict.refusal:
        fail(verdict.refusal)
    for warning in verdict.warnings:
        click.echo(f"warning: {warning}", err=True)
    for note in verdict.notes:
        click.echo(f"note: {note}", err=True)
        if comments is not None:
            comments.append(note)


def check_mesh_or_fail(spec: Any) -> None:
    """tp divides the model's heads and pp does not exceed its blocks
    (`disttrain.plan.mesh_fit`), with the pod's processes (its GPUs when `auto`)."""
    from disttrain.errors import DisttrainError
    from disttrain.launch.argv import resolve_nproc
    from disttrain.plan.mesh_fit import check_mesh_fits

    try:
        check_mesh_fits(spec, resolve_nproc(spec, gpus=spec.cluster.gpus))
    except DisttrainError as exc:
        fail(str(exc))


def render_or_fail(spec: Any, *, local: bool = False, plan: bool = True,
                   comments: list[str] | None = None) -> Any:
    """`render(spec)` with a SpecError as exit 2 and the render's warnings on stderr; before
    it (not for the local emulation), the memory plan's check of the slice."""
    from disttrain.k8s.render import render

    if not local:
        # The spec's own mistakes first (cheap, exit 2), then the plan (seconds).
        _render_checked(render, _with_placeholder_gpumem(spec))
        if plan:   # the model against tp/pp (heads, blocks), built as the plan builds it
            check_mesh_or_fail(spec)
        check_slice_or_fail(spec, plan, comments)
    rendered = _render_checked(render, spec, local)
    for warning in rendered.warnings:
        click.echo(f"warning: {warning}", err=True)
    return rendered


def _with_placeholder_gpumem(spec: Any) -> Any:
    """`spec` with `gpumem: auto` replaced by a number, to render it before it is planned."""
    if spec.cluster.gpumem != "auto":
        return spec
    probe = spec.model_copy(deep=True)
    probe.cluster.gpumem = 1024
    return probe


def _render_checked(render: Any, spec: Any, local: bool = False) -> Any:
    from disttrain.errors import SpecError

    try:
        return render(spec, Path("."), local=local)
    except SpecError as exc:
        fail(str(exc))


def connect(kubeconfig: str | None, context: str | None) -> Any:
    """The Cluster of the kubeconfig; one that cannot be read or reached is exit 1."""
    from disttrain.errors import KubeError
    from disttrain.k8s.client import Cluster

    try:
        return Cluster.from_kubeconfig(kubeconfig, context)
    except KubeError as exc:
        cluster_error(exc)


def cluster_error(exc: Exception) -> NoReturn:
    """A cluster failure: one `error:` line, exit 1 (not 2: the input was fine)."""
    click.echo(f"error: {exc}", err=True)
    raise click.exceptions.Exit(1)


def on_cluster(kubeconfig: str | None, context: str | None, call: Callable[[Any], T]) -> T:
    """Connect, then return `call(cluster)`; a KubeError either way is one line, exit 1."""
    cluster = connect(kubeconfig, context)
    return on_cluster_call(cluster, lambda: call(cluster))


def on_cluster_call(cluster: Any, call: Callable[[], T]) -> T:
    """`call()` on a connected cluster; a KubeError is one line, exit 1."""
    from disttrain.errors import KubeError

    try:
        return call()
    except KubeError as exc:
        cluster_error(exc)
