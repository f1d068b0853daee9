"""What both plain DDP references share (benchmarks/plain_ddp.py, plain_chargpt.py): the
start (the clock from the launcher's start, the process group, the device) and the end
(the parameters' fingerprint, the result line and file, the way out of the process).

    t_start, rank, world, local_rank, device = start(args.backend, args.threads)
    ...                                             # the script's own loop
    hashes = params_sha256(model.module, world)     # every rank: a collective
    write_result(result, args.out)                  # rank 0
    leave()                                         # every rank, last

torchrun runs those scripts from this folder, so it is on their `sys.path` first; a copy
passed as `--plain-script` elsewhere needs this file beside it. Plain torch only: nothing of
disttrain, as the references must be.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def process_start(pid: int) -> float:
    """Epoch seconds at which process `pid` started (/proc, clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def start(backend: str, threads: int) -> tuple[float, int, int, int, torch.device]:
    """Set the threads, join the process group; returns (t_start, rank, world, local_rank,
    device). t_start is when torchrun's agent started (this process, without one), so
    `first_step_s` counts the start-up the Trainer's side counts too."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    t_start = process_start(os.getppid() if launched else os.getpid())
    torch.set_num_threads(threads)

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return t_start, rank, world, local_rank, device


def params_sha256(model: torch.nn.Module, world: int) -> list[str]:
    """Every rank's sha256 of `model`'s state (names and bytes), gathered on all ranks: one
    value when the replicas are in sync, and what a Trainer run's `params_sha256` is
    compared with."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    hashes: list[Any] = [None] * world
    dist.all_gather_object(hashes, digest.hexdigest())
    return hashes


def write_result(result: dict[str, Any], out: str | None) -> None:
    """Rank 0's figures: one JSON line on stdout (without the loss curve), and the whole
    of them in `out` when given (what `disttrain bench overhead` reads)."""
    print(json.dumps({k: v for k, v in result.items() if k != "loss_curve"}), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def leave() -> None:
    """End this rank after a barrier, without teardown.

    NOTE: both ranks are done with every collective after the barrier; leave without
    destroy_process_group and interpreter teardown, where torch 2.13's ProcessGroupGloo
    destructor sometimes aborts a finished rank (SIGABRT, "terminate called without an
    active exception"; docs/troubleshooting.md cpp_abort). Timing is over: this costs the
    comparison nothing, and disttrain's own workers leave the same way.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
