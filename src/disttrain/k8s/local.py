"""`disttrain k8s run-local`: the rendered pods as local processes, one network namespace each.

    result = run_local(spec, base_dir=Path("."), out=print)   # root + iproute2 needed

What is deployed is what is tested: every pod of `render(spec)` becomes a process that
runs the container's command with the container's env (kubelet's `$(VAR)` expansion
included), in its own network namespace and UTS namespace (hostname = pod hostname).
The namespaces hang off one bridge inside a private "switch" namespace, addresses come
only from 198.18.0.0/15 (RFC 2544 benchmarking space), and `/etc/netns/<ns>/hosts` maps
the names the cluster's DNS would serve (`<job>-0.<svc>` ...). There is no default route,
so a pod can reach loopback and the other emulated pods, nothing else. Volumes are local
folders (a PVC is one folder shared by all pods, a ConfigMap file is written where it is
mounted). Everything is removed afterwards, also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from disttrain import envvars
from disttrain.errors import LocalRunError
from disttrain.k8s.code import SPEC_PATH
from disttrain.k8s.logtee import tee_tail
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec
from disttrain.spec.paths import is_directory

SUBNET = ipaddress.ip_network("198.18.0.0/15")
POD_NET = ipaddress.ip_network("198.18.0.0/24")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER")



@dataclass(frozen=True)
class LocalPod:
    """One pod as run-local runs it."""

    name: str
    hostname: str
    aliases: tuple[str, ...]  # DNS names that resolve to this pod, canonical first
    address: str
    argv: tuple[str, ...]  # container command, $(VAR)-expanded, container paths
    env: dict[str, str]
    working_dir: str | None
    mounts: tuple[dict[str, Any], ...]
    volumes: dict[str, dict[str, Any]]


@dataclass
class LocalResult:
    exit_codes: dict[str, int]
    logs: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False

    @property
    def exit_code(self) -> int:
        if self.timed_out:
            return 124
        return next((c for c in self.exit_codes.values() if c != 0), 0)

    @property
    def failed(self) -> list[str]:
        return [p for p, c in self.exit_codes.items() if c != 0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` is a literal `$`."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def pod_address(index: int) -> str:
    """The emulated pod's IPv4 address: 198.18.0.<index + 1> (inside 198.18.0.0/15)."""
    addr = POD_NET.network_address + index + 1
    if addr not in POD_NET or addr == POD_NET.broadcast_address:
        raise LocalRunError(f"run-local emulates at most {POD_NET.num_addresses - 2} pods")
    assert addr in SUBNET
    return str(addr)


def local_pods(objects: list[dict[str, Any]], spec: JobSpec) -> list[LocalPod]:
    """The pods the cluster would create from `objects`, with their env resolved."""
    pods: list[LocalPod] = []
    ns = spec.cluster.namespace
    for obj in objects:
        if obj["kind"] == "Pod":
            pods.append(_pod(obj["spec"], obj["metadata"]["name"], [], len(pods), {}))
        elif obj["kind"] == "Job":
            svc = obj["spec"]["template"]["spec"].get("subdomain")
            for i in range(int(obj["spec"]["completions"])):
                host = f"{obj['metadata']['name']}-{i}"
                aliases = [f"{host}.{svc}.{ns}.svc.cluster.local", f"{host}.{svc}"] if svc else []
                pods.append(_pod(obj["spec"]["template"]["spec"], host, aliases, len(pods),
                                 {"index": str(i)}))
        elif obj["kind"] == "PyTorchJob":
            pods += _pytorchjob_pods(obj, ns, start=len(pods))
    if not pods:
        raise LocalRunError("the rendered objects hold no pod to run")
    return pods


def _pytorchjob_pods(obj: dict[str, Any], ns: str, start: int) -> list[LocalPod]:
    """Emulate the training operator: one pod per replica and the env it injects."""
    spec, name = obj["spec"], obj["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    elastic = spec.get("elasticPolicy")
    total = sum(int(r["replicas"]) for r in replicas.values())
    nproc = spec.get("nprocPerNode", "1")
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        podspec = replicas[rtype]["template"]["spec"]
        port = str(podspec["containers"][0]["ports"][0]["containerPort"])
        for i in range(int(replicas[rtype]["replicas"])):
            host = f"{name}-{rtype.lower()}-{i}"
            op = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc}
            if "Master" in replicas:
                rank = str(i if rtype == "Master" else i + 1)
                master = f"{name}-master-0"
                op |= {"MASTER_ADDR": master, "PET_MASTER_ADDR": master, "MASTER_PORT": port,
                       "PET_MASTER_PORT": port, "RANK": rank, "PET_NODE_RANK": rank,
                       "PET_NNODES": str(total), "WORLD_SIZE": str(total * int(nproc))}
            if elastic:
                nodes = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
                op |= {"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}",
                       "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
                       "PET_NNODES": nodes, "PET_RDZV_ID": elastic.get("rdzvId", name),
                       "PET_MAX_RESTARTS": str(elastic.get("maxRestarts", 0))}
            aliases = [f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}"]
            pods.append(_pod(podspec, host, aliases, start + len(pods), {}, extra_env=op))
    return pods


def _pod(podspec: dict[str, Any], host: str, aliases: list[str], index: int,
         fields: dict[str, str], extra_env: dict[str, str] | None = None) -> LocalPod:
    ctr = podspec["containers"][0]
    address = pod_address(index)
    env: dict[str, str] = {}
    for item in ctr.get("env") or []:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        else:
            env[item["name"]] = _field(item["valueFrom"], host, address, fields)
    env |= extra_env or {}
    argv = tuple(expand(a, env) for a in [*(ctr.get("command") or []), *(ctr.get("args") or [])])
    volumes = {v["name"]: v for v in podspec.get("volumes") or []}
    return LocalPod(host, host, (*aliases, host), address, argv, env, ctr.get("workingDir"),
                    tuple(ctr.get("volumeMounts") or []), volumes)


def _field(source: dict[str, Any], host: str, address: str, fields: dict[str, str]) -> str:
    path = (source.get("fieldRef") or {}).get("fieldPath", "")
    if path == "metadata.annotations['batch.kubernetes.io/job-completion-index']":
        return fields["index"]
    if path == "metadata.name":
        return host
    if path == "status.podIP":
        return address
    raise LocalRunError(f"run-local cannot emulate env valueFrom {source}")


def hosts_file(pods: list[LocalPod]) -> str:
    """/etc/hosts of every emulated pod: loopback plus all pods' DNS names."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "::ffff:127.0.0.1\tlocalhost"]
    lines += [f"{p.address}\t{' '.join(p.aliases)}" for p in pods]
    # the same names for IPv4-mapped IPv6 peers, so c10d's reverse lookups succeed offline
    lines += [f"::ffff:{p.address}\t{' '.join(p.aliases)}" for p in pods]
    return "\n".join(lines) + "\n"


def check_host() -> None:
    """Refuse, with the reason, where network namespaces cannot be made."""
    if not sys.platform.startswith("linux"):
        raise LocalRunError("run-local needs Linux network namespaces")
    if os.geteuid() != 0:
        raise LocalRunError("run-local needs root: it creates network namespaces (ip netns) "
                            "and veth pairs; run it with sudo")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("sh", "a shell")):
        if shutil.which(tool) is None:
            raise LocalRunError(f"run-local needs `{tool}` ({package}) on PATH")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise LocalRunError(f"`ip netns` does not work here: {probe.stderr.strip()}")


# -- the emulated network ------------------------------------------------------------------
def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LocalRunError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


@contextmanager
def network(pods: list[LocalPod], tag: str) -> Iterator[dict[str, str]]:
    """Namespaces, veths and hosts files for `pods`; yields pod name -> netns name."""
    switch = f"{tag}-sw"
    names = {p.name: f"{tag}-{i}" for i, p in enumerate(pods)}
    made: list[str] = []
    etc_netns = Path("/etc/netns")
    fresh_etc = not etc_netns.exists()
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts = hosts_file(pods)
        for i, pod in enumerate(pods):
            ns = names[pod.name]
            _ip("netns", "add", ns)
            made.append(ns)
            etc = etc_netns / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            # nothing listens there inside the namespace: unknown names fail fast, offline
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{i}",
                "netns", switch)
            _ip("-n", switch, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{pod.address}/{POD_NET.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(etc_netns / ns, ignore_errors=True)
        if fresh_etc and etc_netns.is_dir() and not any(etc_netns.iterdir()):
            etc_netns.rmdir()


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


def _process_env(pod: LocalPod, mapping: dict[str, str]) -> dict[str, str]:
    """A clean env: a few basics (no proxies), the pod's env, disttrain importable."""
    import disttrain

    env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
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
              timeout_s: float | None = None, grace_s: float = 5.0) -> LocalResult:
    """Render `spec`, then run its pods in emulated hosts; returns exit codes and log tails.

    Raises:
        LocalRunError: not root, no `ip`, or pods that cannot be emulated.
        SpecError: the spec does not render.
    """
    check_host()
    spec = local_spec(spec, base_dir)
    objects = render(spec, base_dir, local=True).objects
    pods = local_pods(objects, spec)
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    tag = f"dt{os.getpid()}"
    root = Path(tempfile.mkdtemp(prefix="disttrain-run-local-"))
    previous = _on_sigterm()
    try:
        files = _Files(root, configmaps)
        plans = [(pod, files.prepare(pod)) for pod in pods]
        with network(pods, tag) as netns:
            return _supervise(plans, netns, root, out, timeout_s, grace_s)
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


def _supervise(plans: list[tuple[LocalPod, dict[str, str]]], netns: dict[str, str],
               root: Path, out: Callable[[str], None], timeout_s: float | None,
               grace_s: float) -> LocalResult:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    tails: dict[str, list[str]] = {}
    lock = threading.Lock()
    readers = []
    result = LocalResult({})
    try:
        for pod, mapping in plans:
            argv = [map_path(a, mapping) for a in _program(pod.argv)]
            cwd = map_path(pod.working_dir, mapping) if pod.working_dir else None
            if cwd is None or not Path(cwd).is_dir():
                cwd = str(root / pod.name)
                Path(cwd).mkdir(parents=True, exist_ok=True)
            cmd = ["ip", "netns", "exec", netns[pod.name], "unshare", "--uts", "--",
                   "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", pod.hostname, *argv]
            procs[pod.name] = subprocess.Popen(
                cmd, env=_process_env(pod, mapping), cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            tails[pod.name] = []
            t = threading.Thread(target=_pump, args=(procs[pod.name], pod.name, tails[pod.name],
                                                     lock, out), daemon=True)
            t.start()
            readers.append(t)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at: float | None = None
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs.values()):
                failed_at = now  # like a Job with backoffLimit 0: the others are stopped
            if failed_at is not None and now - failed_at > grace_s:
                break
            if deadline is not None and now > deadline:
                result.timed_out = True
                break
            time.sleep(0.2)
    finally:
        _stop(procs)
        for t in readers:
            t.join(timeout=5)
    result.exit_codes = {name: _code(p) for name, p in procs.items()}
    result.logs = {name: "\n".join(lines) for name, lines in tails.items()}
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
