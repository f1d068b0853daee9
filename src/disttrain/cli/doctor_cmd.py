"""`disttrain doctor` (preflight checks of this machine) and `disttrain doctor logs`.

    disttrain doctor [--gpus 2 --nproc-per-node 2] [--json]   # preflight, exit 1 on a fail
    disttrain doctor logs job.log | - | --pod NAME | --job NAME [-n NS] [--json]

Exit codes: 0 all good (no failed check / no failure in the log), 1 a failed check or a
named cause, 2 bad input (an unreadable file, no or several log sources) with one
`error:` line. `disttrain lint` and `disttrain env` are in lint_cmd.py and env_cmd.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from disttrain.cli.options import CTX, fail


# -- doctor (preflight) ---------------------------------------------------------------------
@click.group(invoke_without_command=True, context_settings=CTX)
@click.option("--gpus", type=click.IntRange(min=0), default=None,
              help="GPUs the job will use; fail if fewer are visible")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="processes per node the job will start")
@click.option("--master-addr", default=None, help="check this MASTER_ADDR (default: env)")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="check this MASTER_PORT (default: env, else 29500)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, 30), default=2.0,
              show_default=True, help="seconds for each network probe")
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
@click.pass_context
def doctor(ctx: click.Context, gpus: int | None, nproc_per_node: int | None,
           master_addr: str | None, master_port: int | None, timeout_s: float,
           as_json: bool) -> None:
    """Check this machine before a run (torch, GPUs, HAMi limits, ports, network, /dev/shm).

    `disttrain doctor logs FILE` explains why a job failed."""
    if ctx.invoked_subcommand is not None:
        return
    from disttrain.diagnose.preflight import Probe, failed, run_checks

    checks = run_checks(Probe(gpus=gpus, nproc_per_node=nproc_per_node,
                              master_addr=master_addr, master_port=master_port,
                              timeout_s=timeout_s))
    if as_json:
        click.echo(json.dumps({"checks": [c.to_dict() for c in checks],
                               "ok": not failed(checks)}, indent=2))
    else:
        _print_checks(checks)
    raise click.exceptions.Exit(1 if failed(checks) else 0)


def _print_checks(checks: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(show_lines=False, expand=False)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail, c.fix)
    Console(soft_wrap=False).print(table)
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
    click.echo(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")


# -- doctor logs ------------------------------------------------------------------------------
@doctor.command("logs", context_settings=CTX)
@click.argument("source", required=False)
@click.option("--pod", default=None, help="read this pod's log from the cluster")
@click.option("--job", default=None, help="read the logs of every pod of this disttrain job")
@click.option("-n", "--namespace", default="default", show_default=True, help="namespace")
@click.option("-c", "--container", default=None, help="container of --pod")
@click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False),
              help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, K3s's file)")
@click.option("--context", "kube_context", default=None, help="kubeconfig context")
@click.option("--json", "as_json", is_flag=True,
              help="print {cause, title, rank, host, evidence, fix, consequences, confidence, "
                   "confidence_evidence, alternative}")
def logs(source: str | None, pod: str | None, job: str | None, namespace: str,
         container: str | None, kubeconfig: str | None, kube_context: str | None,
         as_json: bool) -> None:
    """Name the root cause of a failed job from its log: FILE, `-` for stdin, --pod or --job.

    Exit 0 when the log shows no failure, 1 when it names a cause (or `unknown`)."""
    given = [x for x in (source, pod, job) if x]
    if len(given) != 1:
        fail("give exactly one log source: a FILE (or - for stdin), --pod NAME or --job NAME")
    if source:
        text = _read_log(source)
    else:
        text = _fetch_k8s(pod, job, namespace, container, kubeconfig, kube_context)
    from disttrain.diagnose.logs import diagnose, format_diagnosis

    d = diagnose(text)
    click.echo(json.dumps(d.to_dict(), indent=2, ensure_ascii=False) if as_json
               else format_diagnosis(d))
    raise click.exceptions.Exit(0 if d.cause == "none" else 1)


def _read_log(source: str) -> str:
    """The log as text; read as bytes and decoded leniently, so a log cut mid-character or
    holding a binary dump still gets a diagnosis instead of a UnicodeDecodeError."""
    if source == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode()
    elif os.path.isdir(source):  # `disttrain run`'s runs/NAME/logs: every rank's files
        from disttrain.diagnose.log_sources import read_log_dir

        text = read_log_dir(source)
        if text is None:
            fail(f"{source}: is a directory with no *.log files (give a log file, or the "
                 f"logs folder of a run)")
        return text
    else:
        from disttrain.errors import SpecError
        from disttrain.spec.paths import check_readable_file

        try:  # checked first: a too-long name, a NUL or a FIFO must not crash or hang
            with open(check_readable_file(source, kind="log file"), "rb") as f:
                data = f.read()
        except SpecError as exc:
            fail(str(exc))
        except OSError as exc:  # gone or changed since the check
            fail(f"{source}: cannot read: {exc.strerror or exc}")
    return data.decode("utf-8", errors="replace")


def _fetch_k8s(pod: str | None, job: str | None, namespace: str, container: str | None,
               kubeconfig: str | None, kube_context: str | None) -> str:
    """One pod's log, or every pod of a job prefixed `[rank N pod]` as `k8s logs` prints.

    The client is looked up, not imported by name, so a disttrain without it still answers
    with the `kubectl logs` way round; a cluster that cannot be read is exit 2 here (the
    doctor was pointed at a log it cannot read, which is no finding about the job)."""
    try:
        from disttrain.k8s import client as kube
    except ImportError as exc:
        fail(f"--pod/--job need disttrain's Kubernetes client ({exc}); save the log with "
             f"`kubectl logs POD > job.log` and run `disttrain doctor logs job.log`")
    cluster_cls = getattr(kube, "Cluster", None)
    if cluster_cls is None or not hasattr(cluster_cls, "pod_log" if pod else "logs"):
        fail("this disttrain has no Kubernetes log reader yet; save the log with "
             "`kubectl logs POD > job.log` and run `disttrain doctor logs job.log`")
    kube_error = getattr(kube, "KubeError", RuntimeError)
    try:
        cluster = cluster_cls.from_kubeconfig(kubeconfig, kube_context)
        if pod:
            return "\n".join(cluster.pod_log(namespace, pod, container, False))
        pod_logs = cluster.logs(namespace, job, follow=False, out=lambda _line: None)
    except kube_error as exc:
        fail(f"cannot read the logs from the cluster: {exc}")
    return "\n".join(f"{p.prefix} {line}" for p in pod_logs for line in p.text.splitlines())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(doctor())
