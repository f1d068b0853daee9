"""Small probes of this machine, shared by `disttrain doctor` and `disttrain env`.

Each probe returns plain data and never raises for a missing device or library: a
machine without GPUs, NVML, /dev/shm or psutil is a normal answer, not a crash. torch,
psutil and pynvml are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from disttrain import envvars

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}


@dataclass
class TorchInfo:
    """What the installed torch offers for distributed training."""

    version: str | None = None
    cuda: str | None = None                 # CUDA version torch was built with (None: CPU build)
    cuda_available: bool = False
    device_count: int = 0
    nccl: str | None = None
    distributed: bool = False
    backends: dict[str, bool] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def torch_info(with_devices: bool = False) -> TorchInfo:
    """Import torch and report versions, CUDA, NCCL and the distributed backends."""
    info = TorchInfo()
    try:
        import torch
    except Exception as exc:   # ImportError, or a broken CUDA library raising OSError
        info.error = f"{type(exc).__name__}: {exc}"
        return info
    info.version = torch.__version__
    info.cuda = torch.version.cuda
    try:
        info.cuda_available = bool(torch.cuda.is_available())
        info.device_count = int(torch.cuda.device_count()) if info.cuda_available else 0
    except Exception as exc:
        info.error = f"CUDA: {exc}"
    with contextlib.suppress(Exception):
        if info.cuda:
            v = torch.cuda.nccl.version()
            info.nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    try:
        import torch.distributed as dist

        info.distributed = bool(dist.is_available())
        if info.distributed:
            for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
                fn = getattr(dist, f"is_{name}_available", None)
                if fn is not None:
                    info.backends[name] = bool(fn())
    except Exception as exc:
        info.error = f"torch.distributed: {exc}"
    if with_devices and info.cuda_available:
        for i in range(info.device_count):
            with contextlib.suppress(Exception):
                p = torch.cuda.get_device_properties(i)
                info.devices.append({"index": i, "name": p.name,
                                     "capability": f"{p.major}.{p.minor}",
                                     "memory_total_mib": p.total_memory // 2**20})
    return info


def nvml_gpu_count() -> int | None:
    """GPUs NVML sees (under HAMi: the container's vGPUs); None without NVML/driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


# -- HAMi: the limits HAMi-core reads from the container's env (docs/cluster.md) ---------
def parse_limit(value: str) -> int | None:
    """HAMi-core's CUDA_DEVICE_MEMORY_LIMIT syntax: N[k|m|g] (bare = bytes); 0 = none."""
    return envvars.parse_memory_limit(value)


def hami_limits(env: Mapping[str, str]) -> dict[str, Any]:
    """The vGPU limits HAMi's device plugin injected into this container, if any (read by
    `envvars.hami_limits`, as the ranks read them for `disttrain top`)."""
    limits = envvars.hami_limits(env)
    default = envvars.parse_memory_limit(env.get(envvars.CUDA_DEVICE_MEMORY_LIMIT, ""))
    detected = bool(limits.memory_limit_mib or default is not None
                    or envvars.CUDA_DEVICE_SM_LIMIT in env
                    or "CUDA_DEVICE_MEMORY_SHARED_CACHE" in env or libvgpu_preloaded())
    return {
        "detected": detected,
        "memory_limit_mib": limits.memory_limit_mib,
        "default_memory_limit_mib": limits.default_memory_limit_mib,
        "sm_limit_percent": limits.sm_limit_percent,
        "isolation_disabled": env.get("CUDA_DISABLE_CONTROL", "").lower() == "true",
        "oversubscribe": env.get("CUDA_OVERSUBSCRIBE", "").lower() == "true",
    }


def libvgpu_preloaded(path: str = "/etc/ld.so.preload") -> bool:
    """HAMi-core is active when /etc/ld.so.preload lists libvgpu.so."""
    try:
        with open(path) as f:
            return "libvgpu" in f.read()
    except OSError:
        return False


# -- network ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    addresses: tuple[str, ...]


def interfaces() -> dict[str, Interface]:
    """Network interfaces with their IPv4/IPv6 addresses (psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        ips = tuple(a.address.split("%")[0] for a in addrs
                    if a.family in (socket.AF_INET, socket.AF_INET6))
        out[name] = Interface(name, bool(stats[name].isup) if name in stats else False, ips)
    return out


def port_in_use(port: int, hosts: tuple[str, ...] = ("0.0.0.0", "127.0.0.1")) -> bool:
    """True when a TCP listener already holds `port` (bind test, as TCPStore would)."""
    from disttrain.launch.ports import port_free

    for host in hosts:
        try:
            if not port_free(port, host):
                return True
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
    return False


def port_owner(port: int) -> str | None:
    """'pid 123 (python)' of the process listening on `port`, when it can be seen."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN" and conn.pid:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except Exception:
        return None
    return None


def resolve(host: str, timeout_s: float) -> list[str]:
    """Addresses of `host`; raises OSError (also when the lookup exceeds the timeout)."""
    result: dict[str, Any] = {}

    def lookup() -> None:
        try:
            result["addrs"] = sorted({ai[4][0] for ai in socket.getaddrinfo(
                host, None, type=socket.SOCK_STREAM)})
        except OSError as exc:
            result["error"] = exc

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise OSError(f"name lookup took longer than {timeout_s:g}s")
    if "error" in result:
        raise result["error"]
    return result["addrs"]


def connect(addr: str, port: int, timeout_s: float) -> str:
    """'open', 'refused', 'timeout' or the error, for one TCP connect attempt."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return exc.strerror or str(exc)


def shm_size(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory filesystem, None when it is missing."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def nofile_limit() -> tuple[int, int] | None:
    """(soft, hard) open-file limit of this process."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return int(soft), int(hard)
    except (ImportError, OSError, ValueError):
        return None


def cpu_load() -> tuple[float, int] | None:
    """(1-minute load average, CPUs this process may use), None where unknown."""
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return os.getloadavg()[0], cores or 1
    except OSError:
        return None


def in_kubernetes(env: Mapping[str, str]) -> bool:
    return "KUBERNETES_SERVICE_HOST" in env or os.path.exists(
        "/var/run/secrets/kubernetes.io/serviceaccount")
