"""Fit the title and fix to what the log shows about the job: its launcher and its backend.

The same cause needs different words in different jobs. A taken master port is fixed
with `--master-port` under torchrun (which sets MASTER_PORT for its workers and ignores
the shell's), with `--master-port 0` under `disttrain run`, and in the script itself when
the script sets `os.environ["MASTER_PORT"]` (which overrides any launcher). A lost peer
connection on a gloo job is not an NCCL problem, and its debugging knobs are gloo's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disttrain.diagnose.log_hits import Hit
from disttrain.diagnose.log_parse import Line

_TORCHRUN = re.compile(r"torch/distributed/run\.py|torch\.distributed\.run|torchrun|"
                       r"torch/distributed/elastic/|ChildFailedError|torch\.distributed\.launch")
_DISTTRAIN = re.compile(r"^error: the job failed \(failed rank|disttrain run|disttrain\.worker")
_SPAWN = re.compile(r"torch/multiprocessing/spawn\.py|^-- Process \d+ terminated with|"
                    r"ProcessRaisedException|ProcessExitedException")
_GLOO = re.compile(r"gloo|ProcessGroupGloo", re.IGNORECASE)
_NCCL = re.compile(r"NCCL (?:INFO|WARN)|ProcessGroupNCCL|ncclSystemError|ncclRemoteError|"
                   r"NCCL error")
_SETS_PORT = re.compile(r"""os\.environ\[['"]MASTER_PORT['"]\]\s*=|MASTER_PORT['"]?\s*:\s*['"]?\d""")


@dataclass(frozen=True)
class JobContext:
    """What the log says about how the job ran."""

    launcher: str | None       # torchrun | disttrain | spawn | None
    backend: str | None        # gloo | nccl | None
    script_sets_port: bool


def context(lines: list[Line]) -> JobContext:
    """The launcher and backend the log shows (None when it does not say)."""
    launcher = backend = None
    sets_port = False
    gloo = nccl = False
    for line in lines:
        text = line.text
        if launcher is None or launcher == "torchrun":
            if _DISTTRAIN.search(text):
                launcher = "disttrain"
            elif launcher is None and _TORCHRUN.search(text):
                launcher = "torchrun"
            elif launcher is None and _SPAWN.search(text):
                launcher = "spawn"
        gloo = gloo or bool(_GLOO.search(text))
        nccl = nccl or bool(_NCCL.search(text))
        sets_port = sets_port or ("MASTER_PORT" in text and bool(_SETS_PORT.search(text)))
    if gloo != nccl:
        backend = "gloo" if gloo else "nccl"
    return JobContext(launcher, backend, sets_port)


def enrich(hit: Hit) -> dict[str, str]:
    """Derived fields for titles and fixes (human units, the port, parameter names)."""
    f = dict(hit.fields)
    if hit.cause == "port_in_use" and "port" in f:
        f["port_txt"] = f" {f['port']}"
    if hit.cause in ("cuda_oom", "gpu_slice_oom", "gpu_slice_too_small"):
        if "used" in f and "limit" in f:
            f["used"] = f"{int(f['used']) / 2**20:,.0f} MiB"
            f["limit"] = f"{int(f['limit']) / 2**20:,.0f} MiB"
        if "req" in f:
            where = f" on GPU {f['gpu']} of {f['cap']}" if "gpu" in f and "cap" in f else ""
            f["detail"] = f" (tried to allocate {f['req']}{where})"
    for name, alias in (("addr", "addr2"), ("addr", "addr3"), ("port", "port2")):
        if name not in f and alias in f:
            f[name] = f[alias]
    if (hit.cause == "rendezvous_failure" and "joined" in f and "expected" in f
            and int(f["joined"]) > int(f["expected"])):
        f["title_suffix"] = (": more processes joined than WORLD_SIZE (two jobs on one "
                             "store, or WORLD_SIZE too small)")
    if hit.cause == "unused_parameters":
        if "names" in f:
            f["title_suffix"] = f": {f['names'].strip()[:200]}"
        elif "indices" in f:
            f["title_suffix"] = f" (parameter indices {f['indices'].strip()[:100]})"
    if hit.cause == "checkpoint_mismatch":
        f["ckpt_detail"] = _checkpoint_detail(f)
    if hit.cause == "ddp_mark_ready_twice" and "param" in f:
        f["title_suffix"] = f"; parameter {f['param']}"
    return f


def _checkpoint_detail(f: dict[str, str]) -> str:
    """What differs, a few keys of each kind: torch's load_state_dict message, or the
    difference disttrain's resume check already wrote."""
    if "ckpt_diff" in f:
        return f" ({f.get('ckpt', 'the checkpoint')}: {f['ckpt_diff'].strip()[:300]})"
    parts = []
    for field, what in (("missing", "missing from the checkpoint"),
                        ("unexpected", "not in the model")):
        if field in f:
            keys = [k.strip().strip('"') for k in f[field].rstrip(". ").split(",") if k.strip()]
            more = f", ... ({len(keys) - 3} more)" if len(keys) > 3 else ""
            parts.append(f"{what}: {', '.join(keys[:3])}{more}")
    if "mismatch" in f:
        parts.append(f"{f['mismatch']}: checkpoint {f['saved']}, model {f['current']}")
    return f" ({'; '.join(parts)})" if parts else ""


def tailor(hit: Hit, title: str, fix: str, ctx: JobContext) -> tuple[str, str]:
    """The title and fix for this job's launcher and backend."""
    if hit.cause == "port_in_use" and (hit.sig is None or hit.sig.fix is None):
        fix = _port_fix(ctx, hit.fields.get("port"))
    elif hit.cause == "user_code_error" and "exit_code" in hit.fields:
        code = hit.fields["exit_code"]
        rank = f"rank {hit.rank}" if hit.rank is not None else "a rank"
        title = (f"{rank} exited with code {code} on its own (sys.exit / exit() in the "
                 f"script), without a Python error")
        fix = (f"The script ended itself with exit code {code}: look for `sys.exit({code})` "
               f"or `exit({code})` (or a library that calls it) and for what the rank printed "
               f"just before; the launcher then stopped the other ranks. No distributed "
               f"setting is involved.")
    elif hit.cause == "nccl_network_error" and ctx.backend == "gloo":
        title = title.replace("NCCL/gloo network error", "gloo network error")
        fix = fix.replace("NCCL_SOCKET_IFNAME, the MTU", "GLOO_SOCKET_IFNAME, the MTU")
    return title, fix


def unknown_fix(fix: str, ctx: JobContext) -> str:
    """`unknown`'s advice without NCCL knobs on a job that never used NCCL."""
    if ctx.backend == "gloo":
        return fix.replace("NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=INFO",
                           "TORCH_CPP_LOG_LEVEL=INFO and TORCH_DISTRIBUTED_DEBUG=DETAIL")
    return fix


def _port_fix(ctx: JobContext, port: str | None) -> str:
    port = port or "$MASTER_PORT"
    find = (f"Another process listens on port {port} (often an earlier job still running, or "
            f"two jobs on one node): find it with `ss -ltnp | grep {port}` and stop it, or "
            f"use another port. ")
    if ctx.script_sets_port:
        return find + ("The script sets os.environ[\"MASTER_PORT\"] itself, which overrides "
                       "the launcher's port: change or remove that line (torchrun "
                       "--master-port and `export MASTER_PORT` cannot override it).")
    if ctx.launcher == "disttrain":
        return find + ("With disttrain: `disttrain run --master-port 0 ...` picks a free port "
                       "(or give another one).")
    if ctx.launcher == "torchrun":
        return find + ("torchrun sets MASTER_PORT for its workers, so `export MASTER_PORT` has "
                       "no effect: pass `torchrun --master-port 29501 ...`, or on one node "
                       "`torchrun --standalone ...`, which picks a free port. If the script sets "
                       "os.environ[\"MASTER_PORT\"] itself, that value wins: change it there.")
    if ctx.launcher == "spawn":
        return find + ("An mp.spawn script takes MASTER_PORT from its own code or "
                       "environment: change the value it sets before mp.spawn "
                       "(`os.environ[\"MASTER_PORT\"] = \"29501\"`), or `export "
                       "MASTER_PORT=29501` if it reads the shell's.")
    return find + ("Under torchrun pass `--master-port 29501` (torchrun ignores an exported "
                   "MASTER_PORT) or `--standalone` on one node; a script started without a "
                   "launcher reads `export MASTER_PORT=29501` unless it sets the variable "
                   "itself; `disttrain run --master-port 0` picks a free port.")
