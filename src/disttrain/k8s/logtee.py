"""Pumping pods' log lines to the terminal while keeping each pod's tail for the doctor.

    tail: list[str] = []
    tee_tail(pod_lines, "[rank 0 job-0]", tail, lock, click.echo)
    diagnose("\n".join(tail))               # after the pod failed

Shared by client.py (`k8s logs` of cluster pods) and local.py (`k8s run-local`'s emulated
pods), which print their pods the same way; it needs neither a cluster nor processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

LOG_TAIL = 2 * 1024 * 1024  # bytes of each pod's log kept for the doctor


def tee_tail(lines: Iterable[str], prefix: str, tail: list[str], lock: threading.Lock,
             out: Callable[[str], None], limit: int = LOG_TAIL) -> None:
    """Print each line as `prefix line` and keep the last `limit` bytes of them in `tail`.

    Args:
        lines: one pod's log lines, without newlines.
        prefix: what marks this pod's lines, e.g. `[rank 0 job-0]`.
        tail: filled in place, so it keeps what came before an error raised by `lines`.
        lock: held while printing, so the lines of pods pumped at once do not interleave.
        out: where the lines go (click.echo, print).
        limit: bytes kept in `tail`, newlines included (what the doctor reads).

    Example:
        >>> tail: list[str] = []
        >>> tee_tail(["a", "b"], "[p]", tail, threading.Lock(), print, limit=2)
        [p] a
        [p] b
        >>> tail
        ['b']
    """
    size = sum(len(line) + 1 for line in tail)
    for line in lines:
        with lock:
            out(f"{prefix} {line}")
        tail.append(line)
        size += len(line) + 1
        while size > limit and tail:
            size -= len(tail.pop(0)) + 1
