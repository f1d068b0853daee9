"""RUN_DIR/ranks.json: where each rank of the current round runs (host, pid, device).

    identify(run_dir, "mnist", rt)       # every rank calls it once per (re)start
    hosts = read_ranks(run_dir)          # {rank: record}, e.g. to name a lost host's ranks

Why: a job spread over hosts fails on one of them; to act on it (kill a rank, read its
log, find it in `top`) you need to know which host and pid carry rank 7 *now*, after
restarts moved them. Every rank contributes its record with one `all_gather_object` at
startup (one collective per round, nothing per step) and rank 0 writes the file
atomically, so it always describes one whole round: each restart rewrites it
(docs/resilience.md, "Which process is which"). One file written by rank 0 rather than one
per rank merged later: nothing is left behind by a rank of an earlier round.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain import envvars
from disttrain.resilience.proctitle import set_rank_title
from disttrain.rundir import RANKS_JSON, write_text_atomic

if TYPE_CHECKING:
    from disttrain.distributed.runtime import Runtime



def rank_record(rank: int, local_rank: int, device: str) -> dict[str, Any]:
    """This process's entry: rank, host, pid, local rank, node rank (torchrun's
    GROUP_RANK, None outside torchrun), device and restart round."""
    node = os.environ.get(envvars.GROUP_RANK)
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": local_rank, "node_rank": int(node) if node and node.isdigit() else None,
            "device": device, "restart": envvars.restart_count()}


def identify(run_dir: Path, job: str, rt: Runtime) -> Path | None:
    """Title this process with the job's name and write ranks.json (`write_ranks`); a
    single process is titled only when it is a launcher's worker, never a user's own."""
    if rt.env.worker:
        set_rank_title(rt.rank, rt.world_size, job)
    return write_ranks(run_dir, job, rt)


def write_ranks(run_dir: Path, job: str, rt: Runtime) -> Path | None:
    """Gather every rank's record (a collective: all ranks call this) and write ranks.json
    on rank 0; returns its path there, None on the other ranks."""
    records = rt.all_gather_object(rank_record(rt.rank, rt.local_rank, str(rt.device)))
    if not rt.is_rank0:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RANKS_JSON
    doc = {"job": job, "world_size": rt.world_size, "restart": envvars.restart_count(),
           "written": round(time.time(), 3), "ranks": records}
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_ranks(run_dir: Path) -> dict[int, dict[str, Any]]:
    """{rank: record} from ranks.json; empty when there is none (yet) or it is unreadable."""
    try:
        doc = json.loads((run_dir / RANKS_JSON).read_text())
        return {int(r["rank"]): r for r in doc["ranks"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def ranks_on(host: str, ranks: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks a host carried, in order (to name what a lost host took with it)."""
    return sorted(r for r, rec in ranks.items() if rec.get("host") == host)
