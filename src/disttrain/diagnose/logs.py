"""Name the root cause of a failed distributed job from its log.

    disttrain doctor logs job.log          # or: kubectl logs POD | disttrain doctor logs -
    disttrain doctor logs --json job.log

    from disttrain.diagnose.logs import diagnose, format_diagnosis
    d = diagnose(text)          # Diagnosis(cause="cuda_oom", rank=1, host=..., evidence=[...])
    print(format_diagnosis(d))

A failed job prints many errors and only one is the cause: when rank 1 runs out of GPU
memory, rank 0 later reports an NCCL watchdog timeout, and torchrun reports both. The
rules in `log_rules` grade every message by how strongly it names a cause; the strongest
wins, and among equals the rank torchrun saw fail first (its "Root Cause" record), then
the earliest line. Everything else found becomes `consequences`. An exception no rule
explains is the user's own bug (`user_code_error`) and beats the peers' "connection
closed" errors it caused. `unknown` is said plainly rather than guessed.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

from disttrain.diagnose.log_advice import JobContext, context, enrich, tailor, unknown_fix
from disttrain.diagnose.log_confidence import Confidence, grade, select
from disttrain.diagnose.log_hits import (
    Hit,
    demote_consequences,
    exception_hits,
    record_hits,
    signature_hits,
)
from disttrain.diagnose.log_normalize import normalize
from disttrain.diagnose.log_parse import (
    FailureRecord,
    Line,
    find_exceptions,
    parse_summary,
    split_lines,
)
from disttrain.diagnose.log_rules import (
    CAUSES,
    FAILURE_SIGNAL,
    FIELD_DEFAULTS,
    TRAINING_MARKER,
)
from disttrain.diagnose.log_rules_hami import refine_for_hami

__all__ = ["CAUSES", "Diagnosis", "diagnose", "format_diagnosis"]

MAX_EVIDENCE = 8
MAX_EVIDENCE_CHARS = 300
_AGENT_FAILED = re.compile(r"failed \(exitcode: -?\d+\) local_rank: (\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class Diagnosis:
    """What `disttrain doctor logs` concluded about a log.

    Attributes:
        cause: one of CAUSES' ids (`cuda_oom`, ..., `none`, `unknown`).
        title: one line saying what happened.
        rank: the first failing global rank when the log tells, else None.
        host: its host (torchrun summary), pod (kubectl prefix) or NCCL host name.
        evidence: the log lines the conclusion rests on, as they appear in the log.
        fix: what to change.
        consequences: ids of other causes seen, which followed from the root cause.
        confidence: `high`, `medium` or `low` (log_confidence says when each is given).
        confidence_evidence: the lines that decided the confidence.
        alternative: the other cause that is possible (always named when `low`), or None.
    """

    cause: str
    title: str
    rank: int | None = None
    host: str | None = None
    evidence: list[str] = field(default_factory=list)
    fix: str = ""
    consequences: list[str] = field(default_factory=list)
    confidence: str = "low"
    confidence_evidence: list[str] = field(default_factory=list)
    alternative: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The `--json` shape: cause, title, rank, host, evidence, fix, consequences,
        confidence, confidence_evidence, alternative."""
        return {"cause": self.cause, "title": self.title, "rank": self.rank,
                "host": self.host, "evidence": list(self.evidence), "fix": self.fix,
                "consequences": list(self.consequences), "confidence": self.confidence,
                "confidence_evidence": list(self.confidence_evidence),
                "alternative": self.alternative}

    @property
    def failed(self) -> bool:
        """True unless the log shows no failure (cause `none`)."""
        return self.cause != "none"


def diagnose(text: str) -> Diagnosis:
    """The root cause of the failure this log shows (never raises).

    Args:
        text: a job's output: torchrun / mp.spawn output, worker logs, NCCL debug lines,
            `kubectl logs` of one or several pods (prefixed or not), in any mix.

    Returns:
        A Diagnosis; `cause` is `none` when no failure shows and `unknown` when a
        failure shows that no rule explains.

    Example:
        >>> diagnose("[rank1]: torch.OutOfMemoryError: CUDA out of memory.").cause
        'cuda_oom'
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        return _diagnose(str(text))
    except Exception as exc:  # NOTE: runs right after a job failed; must never hide it
        return Diagnosis("unknown", f"the log could not be analysed ({type(exc).__name__}: "
                                    f"{exc})", fix=CAUSES["unknown"][1])


def _diagnose(text: str) -> Diagnosis:
    lines = split_lines(normalize(text))
    records = parse_summary(lines)
    _map_local_ranks(lines, records)
    events = find_exceptions(lines)
    hits = signature_hits(lines)
    hits += exception_hits(lines, events, hits)
    hits += record_hits(records, lines, events)
    demote_consequences(hits, lines, events)
    ctx = context(lines)
    if not hits:
        return _no_cause(lines, records, ctx)
    roots = [r for r in records if r.root]
    root_ranks = {r.rank for r in roots if r.rank is not None}
    winner = select(hits, root_ranks)
    refine_for_hami(winner, hits, [line.text for line in lines])   # the slice's OOM, not the card's
    return _build(winner, hits, lines, records, roots, grade(winner, hits, lines, root_ranks),
                  ctx)


def _map_local_ranks(lines: list[Line], records: list[FailureRecord]) -> None:
    """Give agent lines (`local_rank: 1 (pid: 5657)`) and `[default1]:` lines a rank."""
    by_pid = {r.pid: r.rank for r in records if r.pid is not None and r.rank is not None}
    by_local: dict[tuple[str | None, int], int] = {}
    for r in records:
        if r.local_rank is not None and r.rank is not None:
            by_local[(r.pod, r.local_rank)] = r.rank
    for line in lines:
        if line.rank is not None:
            continue
        m = _AGENT_FAILED.search(line.text) if "local_rank:" in line.text else None
        if m and int(m.group(2)) in by_pid:
            line.rank = by_pid[int(m.group(2))]
        elif line.local_rank is not None and (line.pod, line.local_rank) in by_local:
            line.rank = by_local[(line.pod, line.local_rank)]



# -- the diagnosis ------------------------------------------------------------------------
def _build(winner: Hit, hits: list[Hit], lines: list[Line], records: list[FailureRecord],
           roots: list[FailureRecord], conf: Confidence, ctx: JobContext) -> Diagnosis:
    record = _record_for(winner, lines, roots)
    rank = winner.rank
    if rank is None and record is not None:
        rank = record.rank
    if rank is None:   # the same message, seen with a rank prefix elsewhere
        rank = next((h.rank for h in sorted(hits, key=lambda h: h.line)
                     if h.cause == winner.cause and h.rank is not None), None)
    if rank is None:
        local = lines[winner.line].local_rank
        rank = int(winner.fields["hit_local"]) if "hit_local" in winner.fields else local
    if rank is None:
        rank = _only_rank(lines, lines[winner.line].pod)
    host = (winner.fields.get("subject_host") or _host_for(rank, record, records)
            or lines[winner.line].pod
            or _single_host(rank, records) or lines[winner.line].host)
    fields = dict(FIELD_DEFAULTS)
    fields.update(enrich(winner))
    if winner.cause == "collective_timeout":
        fields["stragglers"] = _stragglers(hits, lines, records)
    title, fix = CAUSES[winner.cause]
    if winner.sig is not None:
        title, fix = winner.sig.title or title, winner.sig.fix or fix
    if winner.rank is None and rank is not None:
        winner.rank = rank
    title, fix = tailor(winner, title, fix, ctx)
    title = _format(title, fields) + fields.get("title_suffix", "")
    consequences: list[str] = []
    for h in sorted(hits, key=lambda h: h.line):
        if h.cause != winner.cause and h.cause not in consequences:
            consequences.append(h.cause)
    return Diagnosis(winner.cause, title, rank, host,
                     _evidence(winner, hits, lines, record), _format(fix, fields),
                     consequences, conf.level, conf.evidence, conf.alternative)


def _record_for(winner: Hit, lines: list[Line],
                roots: list[FailureRecord]) -> FailureRecord | None:
    """The torchrun root-cause record that belongs with the winning line, if any."""
    if not roots:
        return None
    if winner.rank is not None:
        same = [r for r in roots if r.rank == winner.rank]
        pod = lines[winner.line].pod
        same_pod = [r for r in same if r.pod == pod]
        return (same_pod or same or [None])[0]
    pod = lines[winner.line].pod
    same_pod = [r for r in roots if r.pod == pod]
    if len(same_pod) == 1:
        return same_pod[0]
    return roots[0] if len(roots) == 1 else None


def _only_rank(lines: list[Line], pod: str | None) -> int | None:
    """The rank of an unprefixed line (NCCL, agent) when its pod/log shows only one rank."""
    ranks = {line.rank for line in lines if line.pod == pod and line.rank is not None}
    return ranks.pop() if len(ranks) == 1 else None


def _host_for(rank: int | None, record: FailureRecord | None,
              records: list[FailureRecord]) -> str | None:
    """The host of `rank` from torchrun's summary (any record of it; or the only host)."""
    if record is not None and record.host and (rank is None or record.rank == rank):
        return record.host
    same = [r.host for r in records if r.host and r.rank == rank and rank is not None]
    return same[0] if same else None


def _single_host(rank: int | None, records: list[FailureRecord]) -> str | None:
    """A one-node job's summary names one host: every rank ran there."""
    hosts = {r.host for r in records if r.host}
    return hosts.pop() if len(hosts) == 1 and rank is not None else None


def _stragglers(hits: list[Hit], lines: list[Line], records: list[FailureRecord]) -> str:
    seen = {line.rank for line in lines if line.rank is not None}
    seen |= {r.rank for r in records if r.rank is not None}
    timed_out = {h.rank for h in hits if h.cause == "collective_timeout" and h.rank is not None}
    others = sorted(seen - timed_out)
    if not timed_out or not others or len(others) > 16:
        return ""
    names = ", ".join(str(r) for r in others)
    return f"Rank(s) that did not report the timeout: {names}; look at what they were doing. "


def _format(template: str, fields: dict[str, str]) -> str:
    try:
        return template.format_map(fields)
    except (KeyError, ValueError, IndexError):
        return template


def _evidence(winner: Hit, hits: list[Hit], lines: list[Line],
              record: FailureRecord | None) -> list[str]:
    idx = [winner.line, *winner.extra]
    others = [h for h in hits if h.cause == winner.cause and h is not winner]
    seen_ranks = {winner.rank}
    for h in sorted(others, key=lambda h: h.line):
        if h.rank not in seen_ranks:   # the same error on other ranks, once each
            idx.append(h.line)
            seen_ranks.add(h.rank)
    if record is not None:
        idx += [i for i in record.lines
                if re.match(r"^\s*(rank|exitcode)\s*:", lines[i].text)]
    out: list[str] = []
    for i in idx:
        text = lines[i].raw.strip()
        if len(text) > MAX_EVIDENCE_CHARS:
            text = text[:MAX_EVIDENCE_CHARS - 3] + "..."
        if text and text not in out:
            out.append(text)
        if len(out) >= MAX_EVIDENCE:
            break
    return out


def _no_cause(lines: list[Line], records: list[FailureRecord], ctx: JobContext) -> Diagnosis:
    """`none` for a clean log of a run; `unknown` for a failure no rule explains."""
    failures = [i for i, line in enumerate(lines)
                if "NCCL INFO" not in line.text and "NCCL WARN" not in line.text
                and FAILURE_SIGNAL.search(line.text)]
    roots = [r for r in records if r.root]
    if not failures and not roots:
        marker = next((ln for ln in lines if TRAINING_MARKER.search(ln.text)), None)
        if marker is not None:
            return Diagnosis("none", CAUSES["none"][0], fix=CAUSES["none"][1],
                             confidence="high", confidence_evidence=[marker.raw.strip()[:300]])
        what = "the log is empty" if not any(ln.text.strip() for ln in lines) else \
            "no failure and no training output found (is this the job's log?)"
        return Diagnosis("unknown", what, fix=unknown_fix(CAUSES["unknown"][1], ctx),
                         alternative="none")
    title, fix = CAUSES["unknown"]
    fix = unknown_fix(fix, ctx)
    rank = host = None
    evidence = [lines[i].raw.strip()[:MAX_EVIDENCE_CHARS] for i in failures[:3]]
    crash = next((r for r in roots if r.signal in ("SIGSEGV", "SIGABRT", "SIGILL")), None)
    segv = any("Segmentation fault" in line.text for line in lines)
    if crash is not None or segv:
        sig = crash.signal if crash is not None else "SIGSEGV"
        title = f"a worker crashed in native code ({sig}) with no Python error"
        fix = ("A crash inside a C/CUDA library. Under HAMi vGPU, known causes are libvgpu "
               "with NCCL's P2P/SHM transports (try NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) "
               "and NCCL >= 2.26.3 with older HAMi-core (try NCCL_CUMEM_HOST_ENABLE=0, or "
               "HAMi >= 2.9). Otherwise run with NCCL_DEBUG=INFO and CUDA_LAUNCH_BLOCKING=1 "
               "and get a core dump or `py-spy dump` of the crashing rank.")
    if roots:
        rank, host = roots[0].rank, roots[0].host
        evidence += [lines[i].raw.strip() for i in roots[0].lines
                     if re.match(r"^\s*(rank|exitcode)\s*:", lines[i].text)]
    return Diagnosis("unknown", title, rank, host, evidence[:MAX_EVIDENCE], fix,
                     confidence="low", confidence_evidence=evidence[:3],
                     alternative="user_code_error" if roots else None)


def format_diagnosis(d: Diagnosis) -> str:
    """The diagnosis for a person: cause, where, evidence, fix, consequences."""
    out = [f"cause: {d.cause} - {d.title}"]
    where = []
    if d.rank is not None:
        where.append(f"rank {d.rank}")
    if d.host:
        where.append(f"host {d.host}")
    if where:
        out.append("where: " + ", ".join(where))
    if d.evidence:
        out.append("evidence:")
        out += [f"  | {e}" for e in d.evidence]
    if d.consequences:
        named = ", ".join(d.consequences)
        out.append(f"then (consequences, not the cause): {named}")
    if d.confidence == "low" and d.alternative and d.cause != "unknown":
        out.append(f"confidence: low (it could also be {d.alternative})")
    if d.fix:
        out.append(textwrap.fill(d.fix, width=100, initial_indent="fix: ",
                                 subsequent_indent="     "))
    return "\n".join(out)
