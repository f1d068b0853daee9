"""Why a pod is not running, and the verdict of a rendezvous some pods never reached.

    pending_reason(pod, events)   # 'Pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpumem.'
    rendezvous_verdict(pods)      # '2 of 4 ranks arrived; missing: pod ddp-1 (Pending: ...)'

A multi-pod job whose pods are placed one at a time can start some pods while the others
wait for GPU room; the started ranks then wait in torchrun's rendezvous until its deadline
(launch.rdzv_timeout_s) and exit. torchrun's own error says only that the rendezvous timed
out; which pod was missing and why is known to whoever watches the pods: the client
(`k8s status`, `k8s logs -f`), from the pod's PodScheduled condition and the scheduler's
FailedScheduling events, and `k8s run-local`, from its own record of pods it held back.
Both print the same line, built here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_NPROC = re.compile(r"^--nproc[-_]per[-_]node=(\d+)$")


@dataclass(frozen=True)
class PodArrival:
    """One pod of a job: did its ranks reach the rendezvous, and if not, why."""

    name: str
    ranks: int
    arrived: bool
    reason: str = ""  # 'Pending: ...' for a pod that never started


def pending_reason(pod: Mapping[str, Any], events: Iterable[Mapping[str, Any]] = ()) -> str | None:
    """'Pending: <the scheduler's message>' for a pod not yet running, else None.

    The message is the PodScheduled condition's (the scheduler writes its last verdict
    there), else the newest FailedScheduling event about the pod, else the waiting
    container's reason (ImagePullBackOff, ContainerCreating ...)."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return None
    name = (pod.get("metadata") or {}).get("name")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            text = cond.get("message") or cond.get("reason")
            if text:
                return f"Pending: {text}"
    mine = [e for e in events if e.get("reason") == "FailedScheduling"
            and (e.get("involvedObject") or {}).get("name") == name]
    if mine:
        newest = max(mine, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
        return f"Pending: {newest.get('message') or 'FailedScheduling'}"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            return f"Pending: {waiting['reason']}{detail}"
    return "Pending: not scheduled yet" if not (pod.get("spec") or {}).get("nodeName") \
        else "Pending: containers not started yet"


def nproc_of(argv: Iterable[str]) -> int:
    """The torchrun processes an argv starts (its --nproc_per_node), 1 if it does not say."""
    for arg in argv:
        m = _NPROC.match(str(arg))
        if m:
            return int(m.group(1))
    return 1


def ranks_per_pod(pod: Mapping[str, Any]) -> int:
    """The torchrun processes of a pod (API JSON)."""
    return nproc_of(arg for ctr in (pod.get("spec") or {}).get("containers") or []
                    for arg in [*(ctr.get("command") or []), *(ctr.get("args") or [])])


def rendezvous_verdict(pods: list[PodArrival]) -> str | None:
    """'k of N ranks arrived; missing: pod X (Pending: ...)', or None when all arrived."""
    missing = [p for p in pods if not p.arrived]
    if not missing:
        return None
    total = sum(p.ranks for p in pods)
    arrived = sum(p.ranks for p in pods if p.arrived)
    names = "; ".join(f"pod {p.name}" + (f" ({p.reason})" if p.reason else "") for p in missing)
    return f"{arrived} of {total} ranks arrived; missing: {names}"


def verdict_from_pods(pods: list[Mapping[str, Any]],
                      events: Iterable[Mapping[str, Any]] = ()) -> str | None:
    """The verdict for a job's pods as the API returns them: a still-Pending pod is
    missing while another pod of the job has started (else there is no rendezvous yet)."""
    events = list(events)
    arrivals = []
    for pod in pods:
        reason = pending_reason(pod, events)
        arrivals.append(PodArrival((pod.get("metadata") or {}).get("name", "?"),
                                   ranks_per_pod(pod), reason is None, reason or ""))
    if not any(a.arrived for a in arrivals):
        return None
    return rendezvous_verdict(arrivals)
