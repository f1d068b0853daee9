"""A job's log from the folder `disttrain run` (torchrun's --log-dir) writes: every rank's files.

torchrun writes each worker's output to `LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/stdout.log`
and `stderr.log`, and a failed worker's `error.json` beside them. `disttrain doctor logs
runs/NAME/logs` reads them all, each line prefixed `[rankN]:` (on one node the local rank
is the rank) as torchrun's own console prefixes it, so that the doctor attributes every
line to its rank; error files are read too (their escaped traceback is unfolded).
"""

from __future__ import annotations

from pathlib import Path

MAX_BYTES = 64 * 2**20   # a log folder bigger than this is read only up to here


def read_log_dir(folder: str | Path) -> str | None:
    """Every rank's log text under `folder`, prefixed by rank; None when it holds no log."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and (p.suffix == ".log" or p.name == "error.json"))
    if not files:
        return None
    parts: list[str] = []
    budget = MAX_BYTES
    for path in files:
        try:
            data = path.read_bytes()[:budget]
        except OSError:
            continue
        budget -= len(data)
        rank = path.parent.name
        prefix = f"[rank{rank}]:" if rank.isdigit() else ""
        parts += [prefix + line for line in data.decode("utf-8", errors="replace").splitlines()]
        if budget <= 0:
            break
    return "\n".join(parts)
