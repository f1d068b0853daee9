"""How a rendered pod stops when the cluster stops it (preemption, eviction, drain,
`kubectl delete`), and why it is then recreated and resumes (docs/cluster.md, "Preemption").

    ctr["command"], ctr["args"] = pod_command(), torchrun_argv
    # pod_command() == ['sh', '-c', STOP_SCRIPT, 'disttrain-pod']
    grace_period_s(spec)          # terminationGracePeriodSeconds: launch.stop_grace_s + 15
    pod_failure_policy("trainer")  # the Job's podFailurePolicy: a stopped pod is no failure

The kubelet sends SIGTERM to the container's PID 1 only, waits
terminationGracePeriodSeconds, then SIGKILLs everything. torchrun as PID 1 forwards the
signal to its workers, but it then exits 1 (its SignalException escapes), whatever the
workers did, so the pod could not say "stopped, resumable". The pod's PID 1 is therefore a
small POSIX shell script: it runs the torchrun argv as its child, forwards SIGTERM / SIGINT
to it as SIGTERM (a plain `sh -c 'torchrun ...'` would not forward anything: the kernel
drops a signal that PID 1 has no handler for), waits for it, and exits
`errors.EXIT_STOPPED` (75) when it was stopped and torchrun did not succeed, or when the
built-in job's rank 0 recorded a clean stop while the pod ran (the pods of a multi-node
job that were not signalled stop at the same step as the signalled one). The Job's
podFailurePolicy then ignores that pod (and any pod with the DisruptionTarget condition,
which the API server sets on preemption, eviction and taint or node-shutdown kills): the
Job controller recreates it without counting it against backoffLimit, and the built-in job
resumes from the newest checkpoint on its run dir (render.py sets `train.resume`).

torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (set to stop_grace_s)
between its SIGTERM and its SIGKILL, where the torch in the image reads it (older torch
waits a fixed 30 s).
"""

from __future__ import annotations

import posixpath
from typing import Any

from disttrain import envvars
from disttrain.errors import EXIT_STOPPED
from disttrain.resilience.preemption import STOP_FILE
from disttrain.spec.job import JobSpec

# Seconds the kubelet waits beyond launch.stop_grace_s: the workers have stop_grace_s
# from torchrun's SIGTERM, which comes within a second of the kubelet's; after they exit
# torchrun closes its rendezvous and c10d store and exits (a few seconds, more when another
# pod is already gone and a TCP connect has to time out). 15 s covers that teardown, so the
# kubelet's SIGKILL never lands while a checkpoint is still being written.
GRACE_MARGIN_S = 15
WRAPPER_NAME = "disttrain-pod"  # $0 of the script: what `ps` shows for PID 1

STARTED = "/tmp/.disttrain-pod-started"  # touched at start: a stop record newer than it is this pod's
# POSIX sh (dash, busybox, bash): the trap is set before the child starts, and a signal
# that came before `pid` was known is forwarded right after; `wait` returns early (above
# 128) when a trapped signal arrives, so it is repeated until the child has really exited;
# when the child exited while the trap ran, `kill -0` already fails and one more `wait`
# collects its own status, which the interrupted one did not (a worker that finished at
# the SIGTERM with 0 was reported stopped, 75; seen under load). bash answers that last
# `wait` with 127 once the status was collected, dash and busybox with the status again.
# Stopped means: this pod was signalled, or (a pod whose ranks stopped because another
# pod's were signalled: they agree on the step together) the built-in job's rank 0 wrote
# its stop record (envvars.STOP_RECORD: RUN_DIR/stop.json) while this pod ran.
STOP_SCRIPT = (
    "trap 'stop=1; [ -z \"$pid\" ] || kill -TERM \"$pid\" 2>/dev/null' TERM INT\n"
    f": > {STARTED} 2>/dev/null\n"
    "\"$@\" &\n"
    "pid=$!\n"
    "[ -z \"$stop\" ] || kill -TERM \"$pid\" 2>/dev/null\n"
    "wait \"$pid\"; rc=$?\n"
    "while kill -0 \"$pid\" 2>/dev/null; do wait \"$pid\"; rc=$?; done\n"
    "wait \"$pid\" 2>/dev/null; last=$?; [ \"$last\" -eq 127 ] || rc=$last\n"
    "[ \"$rc\" -ne 0 ] || exit 0\n"
    f"[ -z \"$stop\" ] || exit {EXIT_STOPPED}\n"
    f"[ -z \"${envvars.STOP_RECORD}\" ] || [ ! \"${envvars.STOP_RECORD}\" -nt {STARTED} ] || "
    f"exit {EXIT_STOPPED}\n"
    "exit \"$rc\"\n")


def pod_command(setup: str = "") -> list[str]:
    """The container `command`; the torchrun argv goes in `args` (they arrive as "$@").

    Args:
        setup: shell lines run first (k8s/install.py's pip install), each ending in a
            newline; a failure there ends the pod with its status.
    """
    return ["sh", "-c", setup + STOP_SCRIPT, WRAPPER_NAME]


def grace_period_s(spec: JobSpec) -> int:
    """The pod's terminationGracePeriodSeconds: the job's stop grace plus torchrun's teardown."""
    return spec.launch.stop_grace_s + GRACE_MARGIN_S


def stop_env(spec: JobSpec, workdir: str | None) -> list[tuple[str, str]]:
    """The env that gives torchrun's workers the whole stop grace before its SIGKILL, and
    (built-in jobs) where the wrapper finds rank 0's record of a clean stop."""
    env = [(envvars.TORCH_ELASTIC_SHUTDOWN_TIMEOUT, str(spec.launch.stop_grace_s))]
    run_dir = pod_run_dir(spec, workdir)
    if not spec.script and posixpath.isabs(run_dir):
        env.append((envvars.STOP_RECORD, posixpath.join(run_dir, STOP_FILE)))
    return env


def pod_run_dir(spec: JobSpec, workdir: str | None) -> str:
    """The built-in job's run dir as the pod sees it (relative when the image's working
    directory, unknown here, decides)."""
    run_dir = spec.train.run_dir or f"runs/{spec.name}"
    return posixpath.join(workdir, run_dir) if workdir else run_dir


def pod_failure_policy(container: str) -> dict[str, Any]:
    """A Job's podFailurePolicy (needs restartPolicy Never): a pod the cluster disrupted, or
    one whose container exited EXIT_STOPPED, is recreated without counting as a failure.

    The exit-code rule carries an empty `onPodConditions`, which Kubernetes 1.27's schema
    still lists as required (the API takes an empty list as "not given").
    """
    return {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": container, "operator": "In",
                                             "values": [EXIT_STOPPED]},
         "onPodConditions": []},
    ]}


def run_dir_warning(spec: JobSpec, workdir: str | None) -> str | None:
    """Why a recreated pod of this built-in job could not resume, or None.

    A Job's pods may be recreated (preemption, eviction, backoffLimit), and each gets a new
    emptyDir; the checkpoints survive only on a volume. With several nodes only rank 0
    writes them, so every pod must see the same folder (the ranks check that they found
    the same checkpoint, train/checkpoint.py).
    """
    if spec.script or (spec.cluster.kind == "pod" and not spec.launch.max_restarts):
        return None
    run_dir = pod_run_dir(spec, workdir)
    c = spec.cluster
    mounts = [v.mount for v in c.volumes if not v.read_only]
    mounts += [c.code.mount] if c.code.delivery == "pvc" else []
    if posixpath.isabs(run_dir) and any(
            posixpath.commonpath([run_dir, m]) == posixpath.normpath(m) for m in mounts):
        return None
    return (f"train.run_dir: {run_dir} is not on a volume, so a recreated pod (preemption, "
            f"eviction, a restart) starts from scratch"
            + (" and the nodes see different checkpoints" if spec.launch.nnodes > 1 else "")
            + "; put it on a shared volume: --volumes '[{name: runs, pvc: NAME, mount: /runs}]'"
            f" --run-dir /runs/{spec.name}")
