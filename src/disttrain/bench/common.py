"""What every benchmark shares: the run directory, size parsing, statistics and plotting.

Benchmarks run their measurement on the job's ranks with `disttrain.launch.launchers.launch_function`.

    run_dir = new_run_dir("allreduce")              # runs/bench-allreduce-20261130T180000Z
    write_results(run_dir, meta, rows)              # results.json + results.jsonl
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}



# -- sizes ------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'4K' -> 4096, '256M' -> 268435456, '1000' -> 1000 (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 4096, 4K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """'4K:256M' -> powers of two from 4 KiB to 256 MiB (nccl-tests `-b -e -f 2`);
    '1M,16M,64M' -> exactly those."""
    if ":" in text:
        lo_text, _, hi_text = text.partition(":")
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo < 1 or hi < lo:
            raise ValueError(f"{text!r}: give MIN:MAX with 1 <= MIN <= MAX")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
        return sizes
    sizes = [parse_size(p) for p in text.split(",") if p.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{text!r}: give sizes such as 4K:256M or 1M,16M,64M")
    return sizes


def format_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# -- run directory --------------------------------------------------------------------
def new_run_dir(kind: str, run_dir: str | Path | None = None) -> Path:
    """runs/bench-<kind>-<UTC timestamp>/ (or `run_dir`), created."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(run_dir) if run_dir else Path("runs") / f"bench-{kind}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict[str, Any]:
    """Where the figures were measured: to compare runs over time."""
    import torch

    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_results(run_dir: Path, kind: str, settings: dict[str, Any], rows: Sequence[dict[str, Any]],
                  summary: Any = None) -> Path:
    """results.json (settings, environment, rows, summary) and results.jsonl (rows)."""
    from disttrain.rundir import write_text_atomic

    doc = {"kind": kind, "settings": settings, "environment": environment(), "rows": list(rows)}
    if summary is not None:
        doc["summary"] = summary
    write_text_atomic(run_dir / "results.json", json.dumps(doc, indent=2) + "\n")
    write_text_atomic(run_dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return run_dir / "results.json"


# -- statistics and plots -------------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, float]:
    """median, min, max: what a noisy shared machine allows one to compare."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp)
    pyplot().close(fig)
    os.replace(tmp, out)
    return out
