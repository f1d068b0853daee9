"""`disttrain doctor`: is this machine (or pod) ready for a distributed run?

    disttrain doctor                       # every check: ok / warn / fail, with the fix
    disttrain doctor --gpus 2 --nproc-per-node 2 --json

    checks = run_checks(Probe(env={...}, gpus=2))   # fakes for any probe in tests

The checks are the usual launch failures (docs/troubleshooting.md), caught before they
cost a run: no GPU visible, the master port taken, a wrong NCCL_SOCKET_IFNAME, a tiny
/dev/shm, an unreachable MASTER_ADDR. Network checks only ever connect to loopback or the given
MASTER_ADDR, with a bounded timeout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disttrain.diagnose import system
from disttrain.diagnose.system import Interface, TorchInfo

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_PORT = 29500   # torchrun's default --master-port
MiB = 2**20
_HAMI_FIX = ("In the HAMi cluster: `schedulerName: hami-scheduler` and `nvidia.com/gpu: N` in "
             "the container's resources.limits; check `nvidia-smi` in the pod.")


@dataclass(frozen=True)
class Check:
    """One preflight result."""

    name: str
    status: str      # ok | warn | fail
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix}


@dataclass
class Probe:
    """What the checks look at. Every field has a real default; tests pass fakes."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    gpus: int | None = None              # GPUs the job will ask for (--gpus)
    nproc_per_node: int | None = None
    master_addr: str | None = None       # overrides env MASTER_ADDR
    master_port: int | None = None       # overrides env MASTER_PORT
    timeout_s: float = 2.0
    torch: Callable[[], TorchInfo] = system.torch_info
    gpu_count: Callable[[], int | None] = system.nvml_gpu_count
    port_in_use: Callable[[int], bool] = system.port_in_use
    port_owner: Callable[[int], str | None] = system.port_owner
    resolve: Callable[[str, float], list[str]] = system.resolve
    connect: Callable[[str, int, float], str] = system.connect
    interfaces: Callable[[], dict[str, Interface]] = system.interfaces
    shm: Callable[[], tuple[int, int] | None] = system.shm_size
    nofile: Callable[[], tuple[int, int] | None] = system.nofile_limit
    cpu_load: Callable[[], tuple[float, int] | None] = system.cpu_load
    hostname: Callable[[], str] = socket.gethostname


def run_checks(probe: Probe | None = None) -> list[Check]:
    """Every preflight check, in a fixed order; a check that breaks reports `fail`."""
    probe = probe or Probe()
    ctx: dict[str, Any] = {}
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(probe, ctx))
        except Exception as exc:   # NOTE: one broken probe must not hide the others
            out.append(Check(fn.__name__.removeprefix("check_"), FAIL,
                             f"the check itself failed: {type(exc).__name__}: {exc}"))
    return out


def _torch(probe: Probe, ctx: dict[str, Any]) -> TorchInfo:
    if "torch" not in ctx:
        ctx["torch"] = probe.torch()
    return ctx["torch"]


def _visible_gpus(probe: Probe, ctx: dict[str, Any]) -> tuple[int, str]:
    if "gpus" not in ctx:
        n = probe.gpu_count()
        ctx["gpus"] = (n, "NVML") if n is not None else (_torch(probe, ctx).device_count,
                                                        "torch")
    return ctx["gpus"]


def check_torch(probe: Probe, ctx: dict[str, Any]) -> Check:
    t = _torch(probe, ctx)
    if t.version is None:
        return Check("torch", FAIL, f"torch cannot be imported ({t.error})",
                     "Install torch (`pip install torch`, or use the guide's pytorch/pytorch "
                     "image).")
    build = f"CUDA {t.cuda} build" if t.cuda else "CPU-only build"
    if not t.cuda:
        if probe.gpus:
            return Check("torch", FAIL, f"torch {t.version}, {build}, but --gpus {probe.gpus}",
                         "Install a CUDA build of torch to use GPUs (e.g. the "
                         "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime image).")
        return Check("torch", OK, f"torch {t.version}, {build}: train with the gloo backend")
    if not t.cuda_available:
        status = FAIL if probe.gpus else WARN
        return Check("torch", status, f"torch {t.version}, {build}, but CUDA is not usable "
                     f"here{': ' + t.error if t.error else ''}",
                     "Check the NVIDIA driver (`nvidia-smi`) and that the container gets the "
                     "GPU. " + _HAMI_FIX)
    nccl = f", NCCL {t.nccl}" if t.nccl else ""
    return Check("torch", OK, f"torch {t.version}, {build}{nccl}, {t.device_count} CUDA "
                 f"device(s)")


def check_distributed(probe: Probe, ctx: dict[str, Any]) -> Check:
    t = _torch(probe, ctx)
    if t.version is None:
        return Check("torch.distributed", FAIL, "torch is missing")
    if not t.distributed:
        return Check("torch.distributed", FAIL, "torch.distributed.is_available() is False",
                     "This torch build has no distributed support; install an official "
                     "build from pytorch.org.")
    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in t.backends.items())
    if probe.gpus and not t.backends.get("nccl"):
        return Check("torch.distributed", FAIL, f"backends: {have}; GPUs requested but no "
                     f"NCCL", "Install a CUDA build of torch (it ships NCCL).")
    if not t.backends.get("gloo"):
        return Check("torch.distributed", WARN, f"backends: {have}",
                     "gloo is missing: CPU training and CPU collectives will not work.")
    return Check("torch.distributed", OK, f"available; backends: {have}")


def check_gpus(probe: Probe, ctx: dict[str, Any]) -> Check:
    n, source = _visible_gpus(probe, ctx)
    env = probe.env
    notes = []
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if var in env:
            notes.append(f"{var}={env[var]!r}")
    note = f" ({', '.join(notes)})" if notes else ""
    detail = f"{n} GPU(s) visible ({source}){note}"
    if probe.gpus is not None and n < probe.gpus:
        return Check("gpus", FAIL, f"{detail}, {probe.gpus} requested",
                     f"{_HAMI_FIX} Do not set CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES "
                     f"by hand (deployment guide §8.2).")
    nproc = probe.nproc_per_node
    if nproc and n and nproc > n:
        return Check("gpus", FAIL, f"{detail}, but {nproc} processes per node",
                     "Start at most one process per GPU (--nproc-per-node <= GPUs): more "
                     "gives 'invalid device ordinal' or NCCL 'Duplicate GPU detected'.")
    return Check("gpus", OK, detail)


def check_hami(probe: Probe, ctx: dict[str, Any]) -> Check:
    h = system.hami_limits(probe.env)
    if not h["detected"]:
        return Check("hami", OK, "no HAMi vGPU limits in this container")
    parts = [f"GPU {i}: {mib} MiB" if mib else f"GPU {i}: no limit"
             for i, mib in h["memory_limit_mib"].items()]
    if h["default_memory_limit_mib"]:
        parts.append(f"default {h['default_memory_limit_mib']} MiB")
    sm = h["sm_limit_percent"]
    if sm:
        parts.append(f"SM limit {sm}%")
    detail = "HAMi limits: " + (", ".join(parts) or "libvgpu preloaded, no limits set")
    if h["isolation_disabled"]:
        return Check("hami", WARN, detail + "; CUDA_DISABLE_CONTROL=true",
                     "Isolation is off (a debugging workaround): this process can use the "
                     "whole card and disturb its neighbours.")
    t = _torch(probe, ctx)
    if t.nccl and _version(t.nccl) >= (2, 26, 3) and probe.env.get(
            "NCCL_CUMEM_HOST_ENABLE") != "0":
        return Check("hami", WARN, detail + f"; NCCL {t.nccl}",
                     "NCCL >= 2.26.3 segfaults under HAMi-core older than HAMi v2.9 "
                     "('Illegal device id' in cuMemCreate): set NCCL_CUMEM_HOST_ENABLE=0 "
                     "unless the cluster runs HAMi >= 2.9.")
    if sm and sm < 100:
        return Check("hami", WARN, detail,
                     f"Compute is time-sliced to about {sm}% of the GPU (averaged, not a hard "
                     f"cap): expect lower throughput; memory is limited per container across "
                     f"all its processes.")
    return Check("hami", OK, detail)


def _master(probe: Probe) -> tuple[str | None, int | None, str | None]:
    """(MASTER_ADDR, MASTER_PORT, error) from flags, then the environment."""
    addr = probe.master_addr if probe.master_addr is not None else probe.env.get("MASTER_ADDR")
    if probe.master_port is not None:
        return addr, probe.master_port, None
    raw = probe.env.get("MASTER_PORT")
    if raw is None:
        return addr, None, None
    try:
        port = int(raw)
    except ValueError:
        return addr, None, f"MASTER_PORT={raw!r} is not a number"
    if not 0 < port < 65536:
        return addr, None, f"MASTER_PORT={port} is out of range (1-65535)"
    return addr, port, None


def _is_local(probe: Probe, ctx: dict[str, Any], addr: str | None) -> bool:
    if addr is None or addr in system.LOCAL_NAMES or addr.startswith("127."):
        return True
    if addr == probe.hostname():
        return True
    own = {a for i in _interfaces(probe, ctx).values() for a in i.addresses}
    return addr in own


def _interfaces(probe: Probe, ctx: dict[str, Any]) -> dict[str, Interface]:
    if "ifaces" not in ctx:
        ctx["ifaces"] = probe.interfaces()
    return ctx["ifaces"]


def check_master_port(probe: Probe, ctx: dict[str, Any]) -> Check:
    addr, port, error = _master(probe)
    if error:
        return Check("master_port", FAIL, error, "Set MASTER_PORT to a free port number, e.g. "
                     "29500.")
    shown = port if port is not None else DEFAULT_PORT
    if not _is_local(probe, ctx, addr):
        return Check("master_port", OK, f"{shown} is on the master {addr}, not on this host")
    if probe.port_in_use(shown):
        owner = probe.port_owner(shown)
        return Check("master_port", FAIL, f"port {shown} is already in use"
                     f"{' by ' + owner if owner else ''} (deployment guide §8.3)",
                     f"Stop what holds it (`ss -ltnp | grep {shown}`) or use another port: "
                     f"`export MASTER_PORT={shown + 1}` / `torchrun --master-port "
                     f"{shown + 1}`; `torchrun --standalone` picks a free one.")
    src = "" if port is not None else " (torchrun's default; MASTER_PORT unset)"
    return Check("master_port", OK, f"port {shown} is free{src}")


def check_master_addr(probe: Probe, ctx: dict[str, Any]) -> Check:
    addr, port, _ = _master(probe)
    if addr is None:
        return Check("master_addr", OK, "MASTER_ADDR unset (torchrun sets it; one node uses "
                     "localhost)")
    try:
        addrs = probe.resolve(addr, probe.timeout_s)
    except OSError as exc:
        return Check("master_addr", FAIL, f"MASTER_ADDR={addr} does not resolve: {exc}",
                     "Use the master pod's Service name (a headless Service must exist; "
                     "name.service.namespace.svc.cluster.local) or its IP; right after the "
                     "pods start, DNS can lag: retry, or start workers after the master.")
    if _is_local(probe, ctx, addr) or any(a.startswith("127.") or a == "::1" for a in addrs):
        return Check("master_addr", OK, f"{addr} is this host ({', '.join(addrs[:3])})")
    target = port if port is not None else DEFAULT_PORT
    state = probe.connect(addrs[0], target, probe.timeout_s)
    where = f"{addr} ({addrs[0]}) port {target}"
    if state == "open":
        return Check("master_addr", OK, f"{where}: reachable, a server listens")
    if state == "refused":
        return Check("master_addr", WARN, f"{where}: host reachable, nothing listens yet",
                     "Normal before the master starts; otherwise check MASTER_PORT and that "
                     "the master pod runs (workers retry until the rendezvous timeout).")
    return Check("master_addr", FAIL, f"{where}: not reachable ({state}, {probe.timeout_s:g}s)",
                 "A firewall or NetworkPolicy blocks the port, or the address is wrong: the "
                 "master pod's IP / Service must be reachable from every worker.")


def ifname_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: `^` excludes, `=` exact, else prefixes."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    items = [s.strip() for s in spec.split(",") if s.strip()]

    def hit(name: str) -> bool:
        return any(name == i if exact else name.startswith(i) for i in items)

    return [n for n in names if hit(n) != exclude]


def check_socket_ifname(probe: Probe, ctx: dict[str, Any]) -> Check:
    ifaces = _interfaces(probe, ctx)
    names = sorted(ifaces)
    listing = ", ".join(f"{n}{'' if ifaces[n].up else ' (down)'}" for n in names) or "none"
    nccl, gloo = probe.env.get("NCCL_SOCKET_IFNAME"), probe.env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        missing = [g for g in (s.strip() for s in gloo.split(",")) if g not in ifaces]
        if missing:
            return Check("socket_ifname", FAIL, f"GLOO_SOCKET_IFNAME={gloo!r}: no interface "
                         f"{', '.join(missing)} (have: {listing})",
                         "GLOO_SOCKET_IFNAME takes concrete interface names (no ^ or = "
                         "syntax); name the one carrying this host's IP, e.g. eth0.")
    if not nccl:
        default = [n for n in ifname_matches("^lo,docker", names) if ifaces[n].up]
        pick = default[0] if default else "none"
        return Check("socket_ifname", OK, f"NCCL_SOCKET_IFNAME unset: NCCL skips lo and "
                     f"docker* and would use {pick} (interfaces: {listing})")
    chosen = ifname_matches(nccl, names)
    if not chosen:
        return Check("socket_ifname", FAIL, f"NCCL_SOCKET_IFNAME={nccl!r} matches no interface "
                     f"(have: {listing})",
                     "Name an interface this host has (`ip -4 addr`; usually eth0 in a pod) "
                     "or unset it; NCCL fails with 'Bootstrap : no socket interface found'.")
    usable = [n for n in chosen if ifaces[n].up and ifaces[n].addresses]
    if not usable:
        return Check("socket_ifname", WARN, f"NCCL_SOCKET_IFNAME={nccl!r} selects "
                     f"{', '.join(chosen)}, but none is up with an address",
                     "Pick an interface that is up and has this host's IP.")
    addr, _, _ = _master(probe)
    if all(n.startswith("lo") for n in usable) and not _is_local(probe, ctx, addr):
        return Check("socket_ifname", WARN, f"NCCL_SOCKET_IFNAME={nccl!r} selects only "
                     f"loopback, but MASTER_ADDR={addr} is another host",
                     "Loopback cannot reach other nodes: name the pod/node interface.")
    return Check("socket_ifname", OK, f"NCCL_SOCKET_IFNAME={nccl!r} selects "
                 f"{', '.join(usable)}")


def check_shm(probe: Probe, ctx: dict[str, Any]) -> Check:
    size = probe.shm()
    fix = ("Mount a bigger /dev/shm: Kubernetes emptyDir {medium: Memory, sizeLimit: 2Gi} at "
           "/dev/shm (disttrain: cluster.shm: 2Gi), Docker --shm-size=2g; or DataLoader "
           "num_workers=0.")
    if size is None:
        return Check("shm", WARN, "/dev/shm is missing", fix)
    total, free = size
    detail = f"/dev/shm {total / MiB:,.0f} MiB ({free / MiB:,.0f} MiB free)"
    if total < 128 * MiB:
        return Check("shm", FAIL, detail + ": too small for DataLoader workers and NCCL "
                     "(containers default to 64 MiB)", fix)
    if total < 1024 * MiB or free < 64 * MiB:
        return Check("shm", WARN, detail + ": may be too small for DataLoader workers", fix)
    return Check("shm", OK, detail)


def check_open_files(probe: Probe, ctx: dict[str, Any]) -> Check:
    limit = probe.nofile()
    if limit is None:
        return Check("open_files", WARN, "open-file limit unknown")
    soft, hard = limit
    detail = f"open-file limit {soft} (hard {hard})"
    fix = ("Raise it (`ulimit -n 65536`, or the container runtime's nofile limit); "
           "DataLoader workers share tensors through file descriptors ('Too many open "
           "files').")
    if soft < 1024:
        return Check("open_files", FAIL, detail, fix)
    if soft < 8192:
        return Check("open_files", WARN, detail, fix)
    return Check("open_files", OK, detail)


def check_cpu_load(probe: Probe, ctx: dict[str, Any]) -> Check:
    """Other processes on the CPUs: CPU training with several threads per rank suffers most.

    NOTE: measured on a 2-vCPU VM (docs/performance.md): one process with 2 OpenMP threads
    averaged 1.4 ms/step on idle cores and up to 36 ms/step while other work ran (its
    threads spin-wait on a shared core); with 1 thread, 2.4-4.8 ms either way.
    """
    load = probe.cpu_load()
    if load is None:
        return Check("cpu_load", OK, "load average unknown")
    avg, cores = load
    detail = f"load average {avg:.1f} on {cores} CPU(s)"
    if avg >= 0.5 * cores:
        return Check("cpu_load", WARN, detail + ": other processes are using the CPUs",
                     "CPU training on a shared machine: use --threads 1 (one OpenMP thread "
                     "per rank) and no more ranks than free cores; benchmarks on a busy "
                     "machine vary by 2x and more.")
    return Check("cpu_load", OK, detail)


def check_dist_env(probe: Probe, ctx: dict[str, Any]) -> Check:
    env = probe.env
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not any(k in env for k in keys):
        return Check("dist_env", OK, "not inside a launched worker (torchrun sets RANK, "
                     "WORLD_SIZE, LOCAL_RANK)")
    vals: dict[str, int] = {}
    for k in keys:
        if k in env:
            try:
                vals[k] = int(env[k])
            except ValueError:
                return Check("dist_env", FAIL, f"{k}={env[k]!r} is not an integer",
                             "Let torchrun set the rank variables.")
    shown = " ".join(f"{k}={v}" for k, v in vals.items())
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in vals and size in vals and not 0 <= vals[rank] < vals[size]:
            return Check("dist_env", FAIL, f"{shown}: {rank} must be in 0..{size}-1",
                         "Let torchrun set the rank variables (--nnodes, --nproc-per-node).")
    n, _ = _visible_gpus(probe, ctx)
    if probe.gpus and "LOCAL_RANK" in vals and n and vals["LOCAL_RANK"] >= n:
        return Check("dist_env", FAIL, f"{shown}, but only {n} GPU(s) visible",
                     "LOCAL_RANK picks the GPU: run at most one process per GPU.")
    return Check("dist_env", OK, shown)


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError:
        return ()


CHECKS: tuple[Callable[[Probe, dict[str, Any]], Check], ...] = (
    check_torch, check_distributed, check_gpus, check_hami, check_master_port,
    check_master_addr, check_socket_ifname, check_shm, check_open_files, check_cpu_load,
    check_dist_env)


def failed(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)
