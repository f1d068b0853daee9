"""`disttrain k8s run-local`: the rendered pods as local processes, one network namespace each.

    result = run_local(spec, base_dir=Path("."), out=print)   # root + iproute2 needed

What is deployed is what is tested: every pod of `render(spec)` becomes a process that
runs the container's command with the container's env (kubelet's `$(VAR)` expansion
included), in its own network namespace and UTS namespace (hostname = pod hostname).
The namespaces, their bridge, addresses (198.18.0.0/15 only) and hosts files are
`disttrain.k8s.netns`'s; a pod reaches loopback and the other emulated pods, nothing else.
Volumes are local folders (a PVC is one folder shared by all pods, a ConfigMap file is
written where it is mounted), and each start of a pod has its own empty TMPDIR, as a
container has its own /tmp. A failed pod is re-created as its workload's controller
would (`backoff_limit`: a Job's backoffLimit), and a pod killed by SIGKILL as a whole is
reported as a lost host with its ranks (from RUN_DIR/ranks.json; docs/resilience.md,
"Hosts lost and partitions"), typed there (`errors.FailureKind.LOST_HOST`: its exit status
comes from `errors.OUTCOMES`). Everything is removed afterwards, also on failure, Ctrl-C
or SIGTERM.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from disttrain import envvars
from disttrain.errors import OUTCOMES, Failure, FailureKind, LocalRunError
from disttrain.k8s.code import SPEC_PATH
from disttrain.k8s.local_pods import LocalPod, expand, local_pods
from disttrain.k8s.logtee import tee_tail
from disttrain.k8s.netns import check_host, network
from disttrain.k8s.pending import PodArrival, nproc_of, rendezvous_verdict
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec
from disttrain.spec.paths import is_directory

__all__ = ["LocalPod", "LocalResult", "expand", "local_pods", "run_local"]
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER")



@dataclass
class LocalResult:
    exit_codes: dict[str, int]
    logs: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    # pod -> its lost host, typed where the SIGKILL is seen (`lost_host`): not re-created
    lost: dict[str, Failure] = field(default_factory=dict)
    verdict: str | None = None  # k of N ranks arrived; missing: pod X (...) (k8s/pending.py)

    @property
    def exit_code(self) -> int:
        """124 after --timeout; a lost host's kind's status (`errors.OUTCOMES`); else the
        first failed pod's."""
        if self.timed_out:
            return 124
        failed = next((c for c in self.exit_codes.values() if c != 0), 0)
        code = OUTCOMES[FailureKind.LOST_HOST].exit_code
        return code if failed and self.lost and code is not None else failed

    @property
    def failed(self) -> list[str]:
        return [p for p, c in self.exit_codes.items() if c != 0]


# -- files -------------------------------------------------------------------------------
class _Files:
    """Local folders standing in for a pod's volumes; maps container paths to them."""

    def __init__(self, root: Path, configmaps: dict[str, dict[str, Any]]) -> None:
        self.root, self.configmaps = root, configmaps

    def prepare(self, pod: LocalPod) -> dict[str, str]:
        mapping: dict[str, str] = {}
        for m in sorted(pod.mounts, key=lambda m: m["mountPath"].count("/")):
            path, vol = m["mountPath"], pod.volumes.get(m["name"], {})
            if "emptyDir" in vol:
                if path == "/dev/shm":
                    continue  # this machine's /dev/shm
                local = self.root / pod.name / f"vol-{m['name']}"
                local.mkdir(parents=True, exist_ok=True)
                mapping[path] = str(local)
            elif "persistentVolumeClaim" in vol:
                local = self.root / f"pvc-{vol['persistentVolumeClaim']['claimName']}"
                local.mkdir(parents=True, exist_ok=True)
                mapping[path] = str(local)
            elif "hostPath" in vol:
                host = vol["hostPath"]["path"]
                if not is_directory(host):  # no OSError on a too-long name
                    raise LocalRunError(f"volume {m['name']}: hostPath {host} does not exist "
                                        f"on this machine (run-local's only node)")
                mapping[path] = host
            elif "configMap" in vol:
                self._configmap(pod, m, vol["configMap"]["name"], mapping)
        if SPEC_PATH in mapping:
            _map_task_dir(Path(mapping[SPEC_PATH]), mapping)
        return mapping

    def _configmap(self, pod: LocalPod, m: dict[str, Any], name: str,
                   mapping: dict[str, str]) -> None:
        cm = self.configmaps.get(name)
        if cm is None:
            raise LocalRunError(f"ConfigMap {name} is not among the rendered objects")
        keys = {**cm.get("data", {}), **{k: None for k in cm.get("binaryData", {})}}
        wanted = [m["subPath"]] if "subPath" in m else list(keys)
        for key in wanted:
            target = m["mountPath"] if "subPath" in m else f"{m['mountPath']}/{key}"
            local = Path(map_path(target, mapping) if _mapped(target, mapping)
                         else str(self.root / pod.name / "root" / target.lstrip("/")))
            local.parent.mkdir(parents=True, exist_ok=True)
            if key in cm.get("data", {}):
                local.write_text(cm["data"][key])
            else:
                local.write_bytes(base64.b64decode(cm["binaryData"][key]))
            mapping[target] = str(local)


def _map_task_dir(spec_file: Path, mapping: dict[str, str]) -> None:
    """The job.yaml's task_dir is the code mount in the container: point it at the local
    folder standing in for that mount, as the container's paths in argv are."""
    data = yaml.safe_load(spec_file.read_text())
    if isinstance(data, dict) and data.get("task_dir"):
        data["task_dir"] = map_path(data["task_dir"], mapping)
        spec_file.write_text(yaml.safe_dump(data, sort_keys=False))


def _mapped(path: str, mapping: dict[str, str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in mapping)


def map_path(text: str, mapping: dict[str, str]) -> str:
    """Rewrite a container path (or `--opt=/path`) to its local folder, longest match first."""
    prefix, sep, value = text.partition("=") if text.startswith("-") else ("", "", text)
    for cpath in sorted(mapping, key=len, reverse=True):
        if value == cpath or value.startswith(cpath.rstrip("/") + "/"):
            return prefix + sep + mapping[cpath] + value[len(cpath):]
    return text


def _program(argv: tuple[str, ...]) -> list[str]:
    head = argv[0] if argv else ""
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if head in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


def _process_env(pod: LocalPod, mapping: dict[str, str], tmp: Path) -> dict[str, str]:
    """A clean env: a few basics (no proxies), `tmp` as TMPDIR (the container's own /tmp:
    what torchrun and the ranks leave there goes with the pod), `envvars.COMM_WAIT` when
    set here, the pod's env, disttrain importable."""
    import disttrain

    env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
    env["TMPDIR"] = str(tmp)
    # the A/B switch of the all-reduce wait (docs/performance.md) reaches the pods too
    if envvars.COMM_WAIT in os.environ:
        env[envvars.COMM_WAIT] = os.environ[envvars.COMM_WAIT]
    src = str(Path(disttrain.__file__).resolve().parents[1])
    env[envvars.PYTHONPATH] = os.pathsep.join(p for p in (src, os.environ.get(envvars.PYTHONPATH)) if p)
    env |= {k: map_path(v, mapping) for k, v in pod.env.items()}
    env["HOSTNAME"] = pod.hostname
    return env


# -- running -----------------------------------------------------------------------------
def local_spec(spec: JobSpec, base_dir: Path) -> JobSpec:
    """The spec run-local renders: run dir made absolute so every pod shares it."""
    run_dir = Path(spec.train.run_dir or f"runs/{spec.name}")
    run_dir = run_dir if run_dir.is_absolute() else (base_dir / run_dir).resolve()
    return spec.model_copy(update={"train": spec.train.model_copy(
        update={"run_dir": str(run_dir)})})


def run_local(spec: JobSpec, base_dir: Path, *, out: Callable[[str], None],
              timeout_s: float | None = None, grace_s: float = 5.0,
              unschedulable: tuple[str, ...] = ()) -> LocalResult:
    """Render `spec`, then run its pods in emulated hosts; returns exit codes and log tails.

    Args:
        unschedulable: pods the emulated scheduler never places (they never start), as
            on a cluster without room for the whole gang: the others wait in the
            rendezvous until launch.rdzv_timeout_s, and the result's verdict names them.

    Raises:
        LocalRunError: not root, no `ip`, or pods that cannot be emulated.
        SpecError: the spec does not render.
    """
    check_host()
    spec = local_spec(spec, base_dir)
    objects = render(spec, base_dir, local=True).objects
    pods = local_pods(objects, spec)
    held = held_pods(pods, unschedulable)
    backoff = backoff_limit(objects)
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    tag = f"dt{os.getpid()}"
    root = Path(tempfile.mkdtemp(prefix="disttrain-run-local-"))
    previous = _on_sigterm()
    try:
        files = _Files(root, configmaps)
        plans = [(pod, files.prepare(pod)) for pod in pods if pod.name not in held]
        with network(pods, tag) as netns:  # a held pod's name resolves, as JobSet/Service DNS does
            result = _supervise(plans, netns, root, out, timeout_s, grace_s,
                                backoff=backoff, run_dir=Path(spec.run_dir))
        if held:
            result.verdict = rendezvous_verdict([
                PodArrival(p.name, nproc_of(p.argv), p.name not in held, held.get(p.name, ""))
                for p in pods])
        return result
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(root, ignore_errors=True)


def _on_sigterm() -> Any:
    """SIGTERM unwinds like Ctrl-C, so the cleanup in `finally` blocks runs."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def held_pods(pods: list[LocalPod], names: tuple[str, ...]) -> dict[str, str]:
    """The pods `--unschedulable` holds back, with the Pending reason run-local records.

    Raises:
        LocalRunError: a name that is not one of the pods, or every pod held.
    """
    known = [p.name for p in pods]
    bad = [n for n in names if n not in known]
    if bad:
        raise LocalRunError(f"--unschedulable {bad[0]}: no such pod; the pods are "
                            f"{', '.join(known)}")
    if names and len(set(names)) == len(known):
        raise LocalRunError("--unschedulable: holding every pod leaves nothing to run")
    return {n: f"Pending: 0/1 nodes are available: run-local --unschedulable {n} (the "
               f"emulated scheduler found no room)" for n in names}


def backoff_limit(objects: list[dict[str, Any]]) -> int:
    """How many pod failures the workload re-creates pods for (0: the first one fails it).

    An Indexed Job re-creates a failed pod until `backoffLimit` failures (render sets it to
    `launch.max_restarts`); a PyTorchJob restarts its pods (`restartPolicy: OnFailure`)
    up to `runPolicy.backoffLimit`; a bare Pod (`restartPolicy: Never`) never comes back.
    """
    for obj in objects:
        if obj["kind"] == "Job":
            return int(obj["spec"].get("backoffLimit", 6))  # Kubernetes' default is 6
        if obj["kind"] == "PyTorchJob":
            policies = {r["restartPolicy"] for r in obj["spec"]["pytorchReplicaSpecs"].values()}
            if "OnFailure" in policies:
                return int((obj["spec"].get("runPolicy") or {}).get("backoffLimit") or 0)
        spec = obj["spec"]["template"]["spec"] if obj["kind"] == "ClusterTrainingRuntime" \
            else obj["spec"] if obj["kind"] == "JobSet" else None
        if spec is not None and (spec.get("failurePolicy") or {}).get("maxRestarts"):
            raise LocalRunError("run-local does not emulate a JobSet's restart of all its pods "
                                "(failurePolicy.maxRestarts); run it with --max-restarts 0, or "
                                "rehearse restarts with --kind job")
    return 0


def lost_host(pod: LocalPod, run_dir: Path | None) -> Failure:
    """A pod killed by SIGKILL as a whole, typed as the lost host it stands for."""
    return Failure(FailureKind.LOST_HOST, lost_host_line(pod, run_dir), error="SIGKILL")


def lost_host_line(pod: LocalPod, run_dir: Path | None) -> str:
    """What a pod killed by SIGKILL took with it: its host and (from ranks.json) ranks."""
    from disttrain.resilience.ranks import ranks_on, read_ranks

    ranks = ranks_on(pod.hostname, read_ranks(run_dir)) if run_dir is not None else []
    which = (f" with rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
             if ranks else "")
    return (f"host {pod.hostname} lost{which}: pod {pod.name} was killed by SIGKILL (a lost "
            f"node, or the OOM killer)")


@dataclass
class _Pods:
    """The running pods: start one (again), pump its output, stop them all."""

    netns: dict[str, str]
    root: Path
    out: Callable[[str], None]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    tails: dict[str, list[str]] = field(default_factory=dict)
    readers: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0   # pod starts so far, re-creations included: each its own TMPDIR

    def start(self, pod: LocalPod, mapping: dict[str, str]) -> None:
        argv = [map_path(a, mapping) for a in _program(pod.argv)]
        cwd = map_path(pod.working_dir, mapping) if pod.working_dir else None
        if cwd is None or not Path(cwd).is_dir():
            cwd = str(self.root / pod.name)
            Path(cwd).mkdir(parents=True, exist_ok=True)
        cmd = ["ip", "netns", "exec", self.netns[pod.name], "unshare", "--uts", "--",
               "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", pod.hostname, *argv]
        # short (root/t<N>): a unix socket's path, a forkserver's under TMPDIR, has 107 bytes
        tmp = self.root / f"t{self.started}"
        tmp.mkdir()
        self.started += 1
        proc = subprocess.Popen(cmd, env=_process_env(pod, mapping, tmp), cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[pod.name] = proc
        tail = self.tails.setdefault(pod.name, [])
        t = threading.Thread(target=_pump, args=(proc, pod.name, tail, self.lock, self.out),
                             daemon=True)
        t.start()
        self.readers.append(t)

    def stop(self) -> None:
        _stop(self.procs)
        for t in self.readers:
            t.join(timeout=5)


def _supervise(plans: list[tuple[LocalPod, dict[str, str]]], netns: dict[str, str],
               root: Path, out: Callable[[str], None], timeout_s: float | None,
               grace_s: float, backoff: int = 0, run_dir: Path | None = None) -> LocalResult:
    """Run the pods to the end, like the workload's controller would: a failed pod is
    re-created while the failures stay within `backoff`; past it (or with 0) the other
    pods are stopped after `grace_s`, as a failed Job terminates its pods."""
    pods = _Pods(netns, root, out)
    result = LocalResult({})
    failures = 0
    try:
        for pod, mapping in plans:
            pods.start(pod, mapping)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at: float | None = None
        while any(p.poll() is None for p in pods.procs.values()):
            now = time.monotonic()
            for pod, mapping in plans:
                code = pods.procs[pod.name].poll()
                if code in (None, 0) or failed_at is not None:
                    continue
                lost = code == -signal.SIGKILL
                if lost:
                    result.lost[pod.name] = lost_host(pod, run_dir)
                if failures < backoff:
                    failures += 1
                    why = (result.lost.pop(pod.name).message if lost else
                           f"pod {pod.name} failed (exit code {_code(pods.procs[pod.name])})")
                    out(f"[run-local] {why}; re-creating it ({failures} of backoffLimit {backoff})")
                    pods.start(pod, mapping)
                else:
                    failed_at = now  # the workload failed: the others are stopped
            if failed_at is not None and now - failed_at > grace_s:
                break
            if deadline is not None and now > deadline:
                result.timed_out = True
                break
            time.sleep(0.2)
    finally:
        pods.stop()
    result.exit_codes = {name: _code(p) for name, p in pods.procs.items()}
    result.logs = {name: "\n".join(lines) for name, lines in pods.tails.items()}
    return result


def _pump(proc: subprocess.Popen[bytes], name: str, tail: list[str], lock: threading.Lock,
          out: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    lines = (raw.decode("utf-8", "replace").rstrip("\n") for raw in proc.stdout)
    tee_tail(lines, f"[{name}]", tail, lock, out)


def _stop(procs: dict[str, subprocess.Popen[bytes]], wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, each pod's process group (only the processes we started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs.values() if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.poll() is None]
            time.sleep(0.1)
    for p in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=wait_s)


def _code(proc: subprocess.Popen[bytes]) -> int:
    code = proc.returncode
    return 137 if code is None else (128 - code if code < 0 else code)
