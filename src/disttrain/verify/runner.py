"""Is the distributed setup correct? Collectives, gradient sync, convergence, versions.

    disttrain verify                                 # 2 gloo ranks on CPU, one rank per GPU
    disttrain verify --nproc-per-node 4 --json       # one JSON object per check and rank

    from disttrain.verify.runner import run_checks, verify_local
    results = run_checks(rt)                         # inside any live process group
    results, code = verify_local(spec)               # launch the ranks like any job
    k8s_spec = verify_job_spec(spec)                 # what `disttrain k8s verify` renders
    results, code = verify_on_cluster(spec, cluster) # render, apply, follow, verdict

The checks themselves (what each one compares, the fault injection used by tests) are
in `disttrain.verify.verify_checks`, a file that needs only torch so it can run in a pod
without disttrain; this module is the launcher side.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain import envvars
from disttrain.verify import verify_checks
from disttrain.verify.verify_checks import (
    CHECKS,
    CONVERGENCE_MARGIN,
    DEFAULT_STEPS,
    FAULT_ENV,
    CheckResult,
    exit_without_teardown,
    json_lines,
    main,
    parse_faults,
    run_checks,
    summary_lines,
    verdict,
)

if TYPE_CHECKING:
    from disttrain.spec.job import JobSpec

__all__ = ["CHECKS", "CONVERGENCE_MARGIN", "DEFAULT_STEPS", "FAULT_ENV", "CheckResult",
           "json_lines", "main", "parse_faults", "parse_verdict", "run_checks", "summary_lines",
           "verdict", "verify_job_spec", "verify_local", "verify_on_cluster"]


def parse_verdict(text: str) -> tuple[list[CheckResult], dict[str, Any] | None]:
    """Results and verdict from `--json` output mixed into a log (e.g. a pod's logs).

    Lines may carry a prefix such as `[rank0]:`; other lines are ignored.
    """
    results: list[CheckResult] = []
    final = None
    fields = set(CheckResult.__dataclass_fields__)
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            obj = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(obj, dict) and "verdict" in obj:
            final = obj
        elif isinstance(obj, dict) and {"check", "rank", "ok", "detail"} <= set(obj):
            results.append(CheckResult(**{k: v for k, v in obj.items() if k in fields}))
    return results, final


def worker(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank under disttrain's launcher: set up, check, tear down; all ranks' results."""
    from disttrain.distributed import runtime

    with runtime.setup(opts.get("backend", "auto"), opts.get("timeout_s", 300.0),
                       threads=opts.get("threads")) as rt:
        results = run_checks(rt, faults=opts.get("fault"), steps=opts.get("steps", DEFAULT_STEPS))
    return [r.to_json() for r in results]


def verify_local(spec: JobSpec, *, fault: str | None = None,
                 steps: int = DEFAULT_STEPS) -> tuple[list[CheckResult], int]:
    """Launch the checks on this machine like any job (torch's elastic launcher).

    Args:
        spec: its `launch` section says how many processes, nodes, which backend, timeout.
        fault: test-only fault injection, as `envvars.VERIFY_FAULT` (default: that variable).
        steps: DDP steps of the gradient-sync / convergence run.

    Returns:
        (results of every rank, exit code: 0 all passed, 1 something failed). A rank that
        crashed appears as a failed "launch" check on that rank.

    Raises:
        ValueError: a malformed `fault` (verify_checks.py needs only torch, so it raises a
            builtin error rather than one of disttrain.errors).
        disttrain.errors.LaunchError: an explicitly requested port is taken.

    Example:
        >>> results, code = verify_local(JobSpec.from_dict({}, {"nproc_per_node": 2}))
    """
    from disttrain.launch.launchers import launch_function

    fault = fault if fault is not None else os.environ.get(envvars.VERIFY_FAULT)
    parse_faults(fault)
    opts = {"backend": spec.launch.backend, "timeout_s": spec.launch.timeout_s, "steps": steps,
            "fault": fault or "", "threads": spec.train.threads}
    outcome = launch_function(spec, worker, opts)
    if outcome.failures:
        results = [CheckResult("launch", rank, False, failure.summary())
                   for rank, failure in sorted(outcome.failures.items())]
        return results, 1
    results = [CheckResult(**r) for r in outcome.values[min(outcome.values)]]
    return results, 0 if verdict(results)["ok"] else 1


def verify_job_spec(spec: JobSpec, *, steps: int = DEFAULT_STEPS) -> JobSpec:
    """The job `disttrain k8s verify` renders: `verify_checks.py` as the script, in the
    ConfigMap, run by torchrun in the pod.

    The user's cluster settings (image, GPUs, HAMi resources, NCCL preset, volumes, node
    selector, env) and launch shape are kept, so the check runs where the training would;
    the code source becomes the ConfigMap (the file needs only torch: no disttrain install),
    restarts are off (a restart would hide the failure being looked for), and the job is
    named `<name>-verify`. Rank 0 of the pod prints `--json` lines and the pod exits
    non-zero when a check fails; read its log with `parse_verdict`.
    """
    from disttrain.spec.job import JobSpec

    data = spec.model_dump()
    data["name"] = spec.name[:56].rstrip("-") + "-verify"
    data["script"] = str(Path(verify_checks.__file__).resolve())
    data["task"], data["task_args"] = None, {}
    data["args"] = ["--json", "--backend", spec.launch.backend,
                    "--timeout-s", f"{spec.launch.timeout_s:g}", "--steps", str(steps)]
    data["launch"]["max_restarts"] = 0
    cluster = data["cluster"]
    cluster["code"] = {"configmap": True, "mount": spec.cluster.code.mount}
    cluster.update(image_has_disttrain=False, install_disttrain=None, pip_index_url=None)
    return JobSpec.model_validate(data)


def verify_on_cluster(spec: JobSpec, cluster: Any, *, out: Any = print, keep: bool = False,
                      steps: int = DEFAULT_STEPS,
                      base_dir: Path | str = ".") -> tuple[list[CheckResult], int]:
    """`disttrain k8s verify`: render the check job, apply it, follow its logs, verdict.

    Args:
        spec: the user's job; its cluster section says where and on what the check runs.
        cluster: a `disttrain.k8s.client.Cluster` (anything with delete_job/apply/logs).
        out: receives each log line that is not a check's JSON object, as it arrives.
        keep: leave the finished job's objects on the cluster (default: delete them).
        steps: DDP steps of the gradient-sync / convergence run.
        base_dir: as for `disttrain.k8s.render.render`.

    Returns:
        (results of every rank, exit code 0 pass / 1 fail); a run that printed no verdict
        (a pod that never started or crashed) is a failed "launch" check naming the pods.

    Raises:
        disttrain.errors.SpecError: the spec cannot be rendered (bad input, exit 2).
        disttrain.errors.KubeError: the cluster refused or could not be reached.
    """
    from disttrain.errors import KubeError
    from disttrain.k8s.render import render

    vspec = verify_job_spec(spec, steps=steps)
    rendered = render(vspec, Path(base_dir))
    ns, name = vspec.cluster.namespace, vspec.name
    # An earlier verify's finished pod would be left "unchanged" and its old log read back.
    with contextlib.suppress(KubeError):  # none there
        cluster.delete_job(ns, name)
    cluster.apply(rendered.objects)

    def show(line: str) -> None:
        if '{"check"' not in line and '{"verdict"' not in line:
            out(line)

    pod_logs = cluster.logs(ns, name, follow=True, out=show)
    results, final = parse_verdict("\n".join(p.text for p in pod_logs))
    if not keep:
        cluster.delete_job(ns, name)
    if final is None:
        failed = [p.pod for p in pod_logs if p.failed] or [p.pod for p in pod_logs]
        results.append(CheckResult("launch", -1, False, f"no verdict in the logs of pod(s) "
                                   f"{', '.join(failed)}; see `disttrain k8s logs {name}`"))
        return results, 1
    return results, 0 if final.get("ok") and verdict(results)["ok"] else 1


if __name__ == "__main__":
    exit_without_teardown(main())
