"""`disttrain k8s top`: the live frame of a job on the cluster, read from its pods.

    reader = pod_reader(cluster, "default", "mnist-ddp")   # run dir from the job's ConfigMap
    run = reader()                                           # a live.LiveRun, as from a run dir

Each rank writes its live file into the run dir of its own pod (or one PVC they share), so
every running pod of the job is asked, through the API server's exec (`kubectl exec`, the
official client's stream), for the text of `RUN_DIR/live/*.json` and `RUN_DIR/summary.json`;
the union is parsed by `live.parse_live`. No port is opened into the pods and nothing runs
in them but `sh` and `cat`. The run dir is the one the job's spec names (job.yaml in its
`<name>-code` ConfigMap, default runs/<name>), relative to the container's working
directory, where exec starts too.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

import yaml

from disttrain.errors import KubeError
from disttrain.k8s.code import SPEC_KEY
from disttrain.k8s.labels import LABEL_JOB
from disttrain.monitor.live import LiveRun, parse_live
from disttrain.rundir import LIVE, SUMMARY

MARK = "==> "   # starts the line before each file's text in the exec's output
ENDED = ("Succeeded", "Failed")


def read_files_command(run_dir: str) -> list[str]:
    """The command run in a pod: each file under a `==> name` line (a missing one: nothing)."""
    script = (f'cd {shlex.quote(run_dir)} 2>/dev/null || exit 0; '
              f'for f in {LIVE}/*.json {SUMMARY}; do [ -f "$f" ] && '
              f'{{ printf "\\n{MARK}%s\\n" "$f"; cat "$f"; }}; done; exit 0')
    return ["sh", "-c", script]


def split_files(output: str) -> dict[str, str]:
    """`==> name` sections of read_files_command's output -> {name: text}."""
    files: dict[str, str] = {}
    for section in output.split(f"\n{MARK}")[1:]:
        name, _, text = section.partition("\n")
        files[name.strip()] = text
    return files


def job_run_dir(cluster: Any, namespace: str, name: str) -> str:
    """The run dir the job's spec names (its ConfigMap's job.yaml), default runs/<name>."""
    from disttrain.k8s.client import ObjectRef

    cm = cluster.get(ObjectRef("ConfigMap", namespace, f"{name}-code")) or {}
    text = (cm.get("data") or {}).get(SPEC_KEY)
    spec = yaml.safe_load(text) if text else None
    run_dir = ((spec or {}).get("train") or {}).get("run_dir") if isinstance(spec, dict) else None
    return str(run_dir or f"runs/{name}")


def pod_reader(cluster: Any, namespace: str, name: str, run_dir: str | None = None,
               exec_timeout_s: float = 20.0) -> Callable[[], LiveRun]:
    """A function returning the job's frame now, for `top.watch(read=...)`.

    Raises (from the function it returns):
        KubeError: the job has no pods.
    """
    folder = run_dir or job_run_dir(cluster, namespace, name)
    command = read_files_command(folder)

    def read() -> LiveRun:
        pods = cluster.list("Pod", namespace, f"{LABEL_JOB}={name}")
        if not pods:
            raise KubeError(f"no pods of disttrain job {name!r} in namespace {namespace} "
                            f"(looked for label {LABEL_JOB}={name})")
        texts, summary = [], None
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        for pod, phase in zip(pods, phases):
            if phase != "Running":
                continue
            containers = (pod.get("spec") or {}).get("containers") or [{}]
            out = cluster.exec_read(namespace, pod["metadata"]["name"], containers[0].get("name"),
                                    command, exec_timeout_s)
            for fname, text in split_files(out).items():
                if fname == SUMMARY:
                    summary = text
                else:
                    texts.append(text)
        run = parse_live(texts, summary)
        run.ended = all(p in ENDED for p in phases)
        return run

    return read
