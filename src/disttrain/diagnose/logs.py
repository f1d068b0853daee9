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

import bisect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

from disttrain.diagnose.log_parse import (
    ExceptionEvent,
    FailureRecord,
    Line,
    find_exceptions,
    parse_summary,
    split_lines,
    user_frame,
)
from disttrain.diagnose.log_rules import (
    CAUSES,
    FAILURE_SIGNAL,
    FIELD_DEFAULTS,
    NEEDLES,
    RANK,
    ROOT,
    SIGNATURES,
    TRAINING_MARKER,
    UNFILTERED,
    WRAPPER_EXCEPTIONS,
    WRAPPER_MESSAGES,
    Signature,
)

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
    """

    cause: str
    title: str
    rank: int | None = None
    host: str | None = None
    evidence: list[str] = field(default_factory=list)
    fix: str = ""
    consequences: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` shape: cause, title, rank, host, evidence, fix, consequences."""
        return {"cause": self.cause, "title": self.title, "rank": self.rank,
                "host": self.host, "evidence": list(self.evidence), "fix": self.fix,
                "consequences": list(self.consequences)}

    @property
    def failed(self) -> bool:
        """True unless the log shows no failure (cause `none`)."""
        return self.cause != "none"


@dataclass
class _Hit:
    cause: str
    strength: int
    line: int                              # index into the lines list
    rank: int | None
    sig: Signature | None = None
    fields: dict[str, str] = field(default_factory=dict)
    extra: list[int] = field(default_factory=list)   # more evidence line indices


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
    lines = split_lines(text)
    records = parse_summary(lines)
    _map_local_ranks(lines, records)
    hits = _signature_hits(lines)
    hits += _exception_hits(lines, find_exceptions(lines), hits)
    hits += _record_hits(records)
    if not hits:
        return _no_cause(lines, records)
    roots = [r for r in records if r.root]
    winner = _select(hits, {r.rank for r in roots if r.rank is not None})
    return _build(winner, hits, lines, records, roots)


# -- collecting hits --------------------------------------------------------------------
def _candidate_lines(lines: list[Line]) -> list[int]:
    """Lines containing a signature's literal start: a few `str.find` over the whole log."""
    if UNFILTERED:
        return list(range(len(lines)))
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line.text) + 1
    joined = "\n".join(line.text for line in lines)
    found: set[int] = set()
    for needle in NEEDLES:
        at = joined.find(needle)
        while at != -1:
            i = bisect.bisect_right(starts, at) - 1
            found.add(i)
            at = joined.find(needle, starts[i + 1]) if i + 1 < len(starts) else -1
    return sorted(found)


def _signature_hits(lines: list[Line]) -> list[_Hit]:
    hits = []
    for i in _candidate_lines(lines):
        line = lines[i]
        for sig in SIGNATURES:
            m = sig.pattern.search(line.text)
            if m is None or (sig.exclude is not None and sig.exclude.search(line.text)):
                continue
            fields = {k: v for k, v in m.groupdict().items() if v is not None}
            # `subject_rank`: the message is about that rank, whoever printed it (rank 0's
            # stall watchdog, also quoted in torchrun's summary under rank 0's name)
            rank = int(fields["subject_rank"]) if "subject_rank" in fields else line.rank
            if rank is None and "hit_rank" in fields:   # e.g. mp.spawn's "process 1 ..."
                rank = int(fields["hit_rank"])
            hit = _Hit(sig.cause, sig.strength, i, rank, sig, fields)
            _follow(hit, lines)
            hits.append(hit)
            break   # the first (most specific) signature of the line decides
    return hits


def _follow(hit: _Hit, lines: list[Line]) -> None:
    """Detail printed in the lines right after a message (same process)."""
    if hit.sig is None or not hit.sig.follow:
        return
    stream = lines[hit.line].stream
    for j in range(hit.line + 1, min(len(lines), hit.line + 12)):
        if lines[j].stream != stream:
            continue
        for pattern in hit.sig.follow:
            m = pattern.search(lines[j].text)
            if m:
                hit.fields.update({k: v for k, v in m.groupdict().items() if v is not None})
                hit.extra.append(j)
                if hit.rank is None and "hit_rank" in hit.fields:
                    hit.rank = int(hit.fields["hit_rank"])


def _exception_hits(lines: list[Line], events: list[ExceptionEvent],
                    hits: list[_Hit]) -> list[_Hit]:
    """`user_code_error` for each exception that no signature explains."""
    explained = {h.line for h in hits}
    out = []
    for ev in events:
        if WRAPPER_EXCEPTIONS.search(ev.type) or WRAPPER_MESSAGES.match(ev.message):
            continue
        stream = lines[ev.line].stream
        # the message may continue on the next lines of the same process
        span = [j for j in range(ev.line, min(len(lines), ev.line + 6))
                if lines[j].stream == stream]
        if any(j in explained for j in span):
            continue
        frame = user_frame(ev)
        where = f"{frame[0]}:{frame[1]} in {frame[2]}" if frame else "see the traceback"
        extra = [frame[3]] if frame else []
        if frame and frame[3] + 1 < len(lines) and lines[frame[3] + 1].stream == stream:
            extra.append(frame[3] + 1)
        msg = ev.message if len(ev.message) <= 200 else ev.message[:197] + "..."
        out.append(_Hit("user_code_error", RANK, ev.line, lines[ev.line].rank, None,
                         {"exc_type": ev.type, "exc_msg": msg or "(no message)",
                          "where": where}, extra))
    return out


def _record_hits(records: list[FailureRecord]) -> list[_Hit]:
    """A first failure that died of SIGBUS: in containers, almost always /dev/shm."""
    out = []
    for rec in records:
        if rec.root and rec.signal == "SIGBUS":
            line = rec.lines[-1] if rec.lines else rec.first_line
            out.append(_Hit("shm_too_small", RANK, line, rec.rank, None,
                            {"detail": " (a worker died of SIGBUS)"}))
    return out


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


# -- choosing the root cause ----------------------------------------------------------------
def _select(hits: list[_Hit], root_ranks: set[int]) -> _Hit:
    """Strongest message; then the rank torchrun saw fail first; then the earliest line."""
    best = max(h.strength for h in hits)
    if best < ROOT and root_ranks:
        first_failing = [h for h in hits if h.strength >= RANK and h.rank in root_ranks]
        if first_failing:
            return min(first_failing, key=lambda h: (-h.strength, h.line))
    pool = [h for h in hits if h.strength == best]
    return min(pool, key=lambda h: (h.rank not in root_ranks, h.line))


def _build(winner: _Hit, hits: list[_Hit], lines: list[Line], records: list[FailureRecord],
           roots: list[FailureRecord]) -> Diagnosis:
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
    host = (_host_for(rank, record, records) or lines[winner.line].pod
            or _single_host(rank, records) or lines[winner.line].host)
    fields = dict(FIELD_DEFAULTS)
    fields.update(_enrich(winner))
    if winner.cause == "collective_timeout":
        fields["stragglers"] = _stragglers(hits, lines, records)
    title, fix = CAUSES[winner.cause]
    if winner.sig is not None:
        title, fix = winner.sig.title or title, winner.sig.fix or fix
    title = _format(title, fields) + fields.get("title_suffix", "")
    consequences: list[str] = []
    for h in sorted(hits, key=lambda h: h.line):
        if h.cause != winner.cause and h.cause not in consequences:
            consequences.append(h.cause)
    return Diagnosis(winner.cause, title, rank, host,
                     _evidence(winner, hits, lines, record), _format(fix, fields),
                     consequences)


def _record_for(winner: _Hit, lines: list[Line],
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


def _enrich(hit: _Hit) -> dict[str, str]:
    """Derived fields for titles and fixes (human units, the port, parameter names)."""
    f = dict(hit.fields)
    if hit.cause == "port_in_use" and "port" in f:
        f["port_txt"] = f" {f['port']}"
    if hit.cause == "cuda_oom":
        if "used" in f and "limit" in f:
            f["used"] = f"{int(f['used']) / 2**20:,.0f} MiB"
            f["limit"] = f"{int(f['limit']) / 2**20:,.0f} MiB"
        if "req" in f:
            where = f" on GPU {f['gpu']} of {f['cap']}" if "gpu" in f and "cap" in f else ""
            f["detail"] = f" (tried to allocate {f['req']}{where})"
    if hit.cause == "rendezvous_failure" and "addr" not in f and "addr2" in f:
        f["addr"] = f["addr2"]
    if hit.cause == "unused_parameters":
        if "names" in f:
            f["title_suffix"] = f": {f['names'].strip()[:200]}"
        elif "indices" in f:
            f["title_suffix"] = f" (parameter indices {f['indices'].strip()[:100]})"
    if hit.cause == "ddp_mark_ready_twice" and "param" in f:
        f["title_suffix"] = f"; parameter {f['param']}"
    return f


def _stragglers(hits: list[_Hit], lines: list[Line], records: list[FailureRecord]) -> str:
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


def _evidence(winner: _Hit, hits: list[_Hit], lines: list[Line],
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


def _no_cause(lines: list[Line], records: list[FailureRecord]) -> Diagnosis:
    """`none` for a clean log of a run; `unknown` for a failure no rule explains."""
    failures = [i for i, line in enumerate(lines)
                if "NCCL INFO" not in line.text and "NCCL WARN" not in line.text
                and FAILURE_SIGNAL.search(line.text)]
    roots = [r for r in records if r.root]
    if not failures and not roots:
        if any(TRAINING_MARKER.search(line.text) for line in lines):
            return Diagnosis("none", CAUSES["none"][0], fix=CAUSES["none"][1])
        what = "the log is empty" if not any(ln.text.strip() for ln in lines) else \
            "no failure and no training output found (is this the job's log?)"
        return Diagnosis("unknown", what, fix=CAUSES["unknown"][1])
    title, fix = CAUSES["unknown"]
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
    return Diagnosis("unknown", title, rank, host, evidence[:MAX_EVIDENCE], fix)


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
    if d.fix:
        out.append(textwrap.fill(d.fix, width=100, initial_indent="fix: ",
                                 subsequent_indent="     "))
    return "\n".join(out)
