"""`disttrain env`: one copy-pasteable report of this environment, for bug reports.

    disttrain env              # versions, devices, distributed env vars, HAMi limits
    disttrain env --gpus       # + per-GPU memory, utilization, processes, NVLink (NVML)
    disttrain env --json

The guide's appendix B commands in one place: `nvidia-smi`, `nvidia-smi pmon`,
`nvidia-smi nvlink -s` and `python -c "import torch; print(torch.distributed.is_available())"`.
Values of variables whose names contain TOKEN, SECRET, PASSWORD or KEY are never printed.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any

from disttrain import envvars
from disttrain.diagnose import system

_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
# variables that matter for distributed training (prefixes end with "_")
ENV_PREFIXES = ("MASTER_", "TORCHELASTIC_", "TORCH_", "NCCL_", "GLOO_", "CUDA_", "NVIDIA_",
                "PYTORCH_", "OMP_", "HF_", "GPU_CORE_", "LIBCUDA_", "DISTTRAIN_", "POD_")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "HOSTNAME",
             "KUBERNETES_SERVICE_HOST", "ACTIVE_OOM_KILLER", "LD_PRELOAD")
MASK = "****"
_INTERNAL = {envvars.T0}   # disttrain's own start clock, not configuration


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """The distributed-relevant variables, secrets masked, sorted by name."""
    out = {}
    for name in sorted(env):
        if not (name in ENV_NAMES or name.startswith(ENV_PREFIXES)) or name in _INTERNAL:
            continue
        value = env[name]
        if _SECRET.search(name):
            value = MASK
        else:
            value = _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", value)
        out[name] = value
    return out


def collect(env: Mapping[str, str] | None = None, gpus: bool = False,
            nvml: Any = None) -> dict[str, Any]:
    """The report as plain data (what `--json` prints).

    Args:
        env: the environment to report (default: os.environ).
        gpus: add per-GPU details from NVML.
        nvml: an NVML module (default: pynvml); tests pass a fake.
    """
    env = dict(os.environ) if env is None else dict(env)
    t = system.torch_info(with_devices=True)
    report: dict[str, Any] = {
        "disttrain": _version("disttrain"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": t.to_dict(),
        "distributed_available": t.distributed,
        "env": masked_env(env),
        "hami": system.hami_limits(env),
        "kubernetes": system.in_kubernetes(env),
        "system": _system(),
        "network": {i.name: list(i.addresses) for i in system.interfaces().values()},
    }
    if gpus:
        report["gpus"] = nvml_report(nvml)
    return report


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _system() -> dict[str, Any]:
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        out["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(Exception):
        import psutil

        out["memory_total_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    shm = system.shm_size()
    out["shm_total_mib"] = shm[0] // 2**20 if shm else None
    out["shm_free_mib"] = shm[1] // 2**20 if shm else None
    out["nofile"] = list(system.nofile_limit() or ()) or None
    return out


def nvml_report(nvml: Any = None) -> dict[str, Any]:
    """Per-GPU memory, utilization, processes and NVLink through NVML (nvidia-smi's source)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return {"available": False, "reason": "NVML bindings missing (pip install "
                    "nvidia-ml-py)", "devices": []}
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "devices": [],
                "reason": f"no NVIDIA GPU here: NVML could not start ({_err(exc)}); "
                          f"`nvidia-smi` would fail the same way"}
    try:
        count = int(nvml.nvmlDeviceGetCount())
        out: dict[str, Any] = {"available": count > 0, "devices": [],
                               "driver": _call(nvml, "nvmlSystemGetDriverVersion"),
                               "cuda_driver": _cuda_version(_call(
                                   nvml, "nvmlSystemGetCudaDriverVersion"))}
        if count == 0:
            out["reason"] = ("NVML works but no GPU is visible to this container (HAMi: request "
                             "nvidia.com/gpu with schedulerName: hami-scheduler)")
        for i in range(count):
            out["devices"].append(_device(nvml, nvml.nvmlDeviceGetHandleByIndex(i), i))
        return out
    except Exception as exc:
        return {"available": False, "devices": [], "reason": f"NVML error: {_err(exc)}"}
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _device(nvml: Any, h: Any, index: int) -> dict[str, Any]:
    mem = _call(nvml, "nvmlDeviceGetMemoryInfo", h)
    util = _call(nvml, "nvmlDeviceGetUtilizationRates", h)
    power = _call(nvml, "nvmlDeviceGetPowerUsage", h)
    dev = {
        "index": index, "name": _text(_call(nvml, "nvmlDeviceGetName", h)),
        "uuid": _text(_call(nvml, "nvmlDeviceGetUUID", h)),
        "memory_used_mib": mem.used // 2**20 if mem is not None else None,
        "memory_total_mib": mem.total // 2**20 if mem is not None else None,
        "utilization_gpu": getattr(util, "gpu", None),
        "utilization_memory": getattr(util, "memory", None),
        "temperature_c": _call(nvml, "nvmlDeviceGetTemperature", h,
                               getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
        "power_w": round(power / 1000, 1) if isinstance(power, (int, float)) else None,
        "processes": _processes(nvml, h),
        "nvlink": _nvlink(nvml, h),
    }
    return dev


def _processes(nvml: Any, h: Any) -> list[dict[str, Any]]:
    """Compute processes with memory, plus SM/memory % per pid like `nvidia-smi pmon`."""
    procs = _call(nvml, "nvmlDeviceGetComputeRunningProcesses", h) or []
    samples = {getattr(s, "pid", None): s for s in
               (_call(nvml, "nvmlDeviceGetProcessUtilization", h, 0) or [])}
    out = []
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        s = samples.get(p.pid)
        out.append({"pid": p.pid, "name": _proc_name(p.pid),
                    "used_memory_mib": used // 2**20 if isinstance(used, int) else None,
                    "sm_percent": getattr(s, "smUtil", None),
                    "mem_percent": getattr(s, "memUtil", None)})
    return out


def _nvlink(nvml: Any, h: Any) -> list[dict[str, Any]]:
    """State and version of each NVLink (`nvidia-smi nvlink -s`); empty without NVLink."""
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
        state = _call(nvml, "nvmlDeviceGetNvLinkState", h, link)
        if state is None:
            break
        links.append({"link": link, "active": bool(state),
                      "version": _call(nvml, "nvmlDeviceGetNvLinkVersion", h, link)})
    return links


def _call(nvml: Any, name: str, *args: Any) -> Any:
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _err(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _cuda_version(v: Any) -> str | None:
    return f"{v // 1000}.{v % 1000 // 10}" if isinstance(v, int) else None


def _proc_name(pid: int) -> str:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:
        return "?"   # another container's process, or gone


def format_report(r: dict[str, Any]) -> str:
    """The report as plain `key: value` lines under headings, ready to paste."""
    t = r["torch"]
    lines = ["## versions",
             f"disttrain: {r['disttrain']}", f"python: {r['python']}",
             f"platform: {r['platform']}", f"hostname: {r['hostname']}",
             f"torch: {t['version'] or 'not importable: ' + str(t['error'])}",
             f"torch CUDA build: {t['cuda'] or 'none (CPU-only build)'}",
             f"NCCL: {t['nccl'] or '-'}",
             f"torch.distributed.is_available(): {r['distributed_available']}",
             "backends: " + (", ".join(f"{k}={'yes' if v else 'no'}"
                                       for k, v in t["backends"].items()) or "-"),
             "", "## devices"]
    if t["cuda_available"]:
        lines += [f"cuda:{d['index']}: {d['name']} (sm {d['capability']}, "
                  f"{d['memory_total_mib']} MiB)" for d in t["devices"]]
    else:
        lines.append("no CUDA device visible to torch")
    h = r["hami"]
    lines += ["", "## HAMi vGPU"]
    if h["detected"]:
        lines += [f"memory limit GPU {i}: {m} MiB" for i, m in h["memory_limit_mib"].items()]
        lines.append(f"SM limit: {h['sm_limit_percent'] or 100}%")
    else:
        lines.append("not a HAMi vGPU container")
    s = r["system"]
    lines += ["", "## system", f"cpus: {s.get('cpus')} (usable {s.get('cpus_usable', '?')})",
              f"memory: {s.get('memory_total_gib', '?')} GiB",
              f"/dev/shm: {s['shm_total_mib']} MiB ({s['shm_free_mib']} MiB free)"
              if s["shm_total_mib"] is not None else "/dev/shm: missing",
              f"open files: {s['nofile']}", f"kubernetes pod: {r['kubernetes']}",
              "network: " + "; ".join(f"{k} {' '.join(v)}" for k, v in r["network"].items()),
              "", "## environment"]
    lines += [f"{k}={v}" for k, v in r["env"].items()] or ["(no distributed variables set)"]
    if "gpus" in r:
        lines += ["", "## GPUs (NVML)", *_format_gpus(r["gpus"])]
    return "\n".join(lines)


def _format_gpus(g: dict[str, Any]) -> list[str]:
    if not g["devices"]:
        return [g.get("reason") or "no GPU"]
    lines = [f"driver {g.get('driver')}, CUDA driver {g.get('cuda_driver')}"]
    for d in g["devices"]:
        lines.append(f"GPU {d['index']}: {d['name']} | {d['memory_used_mib']}/"
                     f"{d['memory_total_mib']} MiB | util {d['utilization_gpu']}% "
                     f"(mem {d['utilization_memory']}%) | {d['temperature_c']} C | "
                     f"{d['power_w']} W")
        for p in d["processes"]:
            lines.append(f"  pid {p['pid']} {p['name']}: {p['used_memory_mib']} MiB, "
                         f"sm {p['sm_percent'] if p['sm_percent'] is not None else '-'}%")
        if not d["processes"]:
            lines.append("  no compute processes")
        active = [f"link {x['link']} v{x['version']}" for x in d["nvlink"] if x["active"]]
        lines.append("  nvlink: " + (", ".join(active) if active else "none active"))
    return lines
