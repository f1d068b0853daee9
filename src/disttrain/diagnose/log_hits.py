"""Every piece of evidence in a log: signature matches, exceptions, torchrun's exit records.

A `Hit` is one line that says something about a cause, with the strength of its
signature. Three sources produce them:

- signatures (log_rules) matched on each line, and on pairs of lines a terminal wrapped
  (a message cut at the terminal's width, its second half without the `[rankN]:`
  prefix);
- Python exceptions that end a traceback: a framework failure seen from the inside (the
  traceback raises from torch's rendezvous/process-group setup, or from shared-memory
  code in multiprocessing) is classified as that cause; only the rest is the user's own
  `user_code_error`;
- torchrun's summary records: a first failure that died of SIGBUS (-7), and a rank that
  left with an exit code of its own choosing (`sys.exit(3)`) and no error.

`demote_consequences` then applies causality between hits of one rank: a C++ abort that
follows the rank's own Python exception is the interpreter tearing down, not the cause.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from disttrain.diagnose.log_parse import ExceptionEvent, FailureRecord, Line, user_frame
from disttrain.diagnose.log_rules import (
    CONSEQUENCE,
    LIKELY,
    NEEDLES,
    RANK,
    ROOT,
    SIGNATURES,
    UNFILTERED,
    WRAPPER_EXCEPTIONS,
    WRAPPER_MESSAGES,
    Signature,
)

_NO_STREAM: tuple[None, None, None] = (None, None, None)
# A terminal wraps at its width: only lines at least this long can have been cut.
MIN_WRAPPED = 60
_NEEDLE_RE = re.compile("|".join(re.escape(n) for n in sorted(NEEDLES, key=len, reverse=True)))
_LONGEST_NEEDLE = max(len(n) for n in NEEDLES)

# Where a framework exception comes from, read from the traceback's frames.
_RDZV_FRAMES = re.compile(
    r"torch/distributed/(?:rendezvous|distributed_c10d|elastic/rendezvous|elastic/agent|"
    r"elastic/utils/store|launcher)")
_RDZV_FUNCS = re.compile(
    r"^(?:init_process_group|_new_process_group_helper|_store_based_barrier|new_group|"
    r"_env_rendezvous_handler|_tcp_rendezvous_handler|_create_c10d_store|rendezvous|"
    r"next_rendezvous|_rendezvous|_create_tcp_store|create_backend|_get_store|"
    r"_initialize_workers|_rendezvous_impl)$")
_FRAMEWORK_TYPES = re.compile(r"(?:^|\.)(?:RuntimeError|DistError|DistStoreError|"
                              r"DistNetworkError|TimeoutError|ConnectionError|"
                              r"ConnectionRefusedError|ConnectionResetError|OSError)$")
_SHM_FRAMES = re.compile(
    r"multiprocessing/(?:synchronize|shared_memory|heap|queues|reduction)\.py|"
    r"torch/multiprocessing/reductions\.py|torch/storage\.py|torch/utils/data/_utils/")
_SHM_FUNCS = re.compile(r"_share_(?:filename|fd)_cpu_|share_memory_|_new_shared|SemLock|"
                        r"shm_open|reduce_storage|_new_using_(?:filename|fd)")
_SHM_ERRNO = re.compile(r"\[Errno (?:28|13|38|12)\]|No space left on device|Permission "
                        r"denied|Function not implemented|Cannot allocate memory|Bus error")
_EXIT_NO_TRACE = re.compile(r"To enable traceback see|^<N/A>$|^$")
# Exceptions that only carry a framework failure named elsewhere in the log (NCCL's own
# WARN lines say why), or the old launcher's report that a worker failed: never user code.
_FRAMEWORK_CARRIERS = re.compile(r"^NCCL error|^NCCL communicator was aborted|ncclInternalError|"
                                 r"ncclInvalidUsage|ncclUnhandledCudaError")
_LAUNCHER_FRAMES = re.compile(r"torch/distributed/(?:launch|run)\.py")
# Causes a process's own exit produces after an error: never the explanation of that error.
TEARDOWN = ("cpp_abort",)


@dataclass
class Hit:
    """One line of evidence for a cause, as strong as its signature."""

    cause: str
    strength: int
    line: int                              # index into the lines list
    rank: int | None
    sig: Signature | None = None
    fields: dict[str, str] = field(default_factory=dict)
    extra: list[int] = field(default_factory=list)   # more evidence line indices
    basis: str = "message"     # message | wrapped | exception | frames | record


def candidate_lines(lines: list[Line]) -> list[int]:
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


def signature_hits(lines: list[Line]) -> list[Hit]:
    """The first (most specific) matching signature of every line, then of wrapped pairs."""
    hits = []
    for i in candidate_lines(lines):
        hit = _match(lines, i, lines[i].text)
        if hit is not None:
            hits.append(hit)
    hit_lines = {h.line for h in hits}
    for i in _wrapped_pairs(lines, hit_lines):
        hit = _match_wrapped(lines, i)
        if hit is not None:
            hits.append(hit)
    return hits


def _match_wrapped(lines: list[Line], i: int) -> Hit | None:
    """A signature read across line i and the one or two lines a terminal cut it into."""
    parts = [lines[i].text]
    for j in (i + 1, i + 2):
        if j >= len(lines) or (j == i + 2 and len(lines[i + 1].raw) < MIN_WRAPPED):
            break
        nxt = lines[j].text.lstrip()
        for joined in ("".join(parts) + nxt, " ".join(p.rstrip() for p in parts) + " " + nxt):
            hit = _match(lines, i, joined)
            if hit is not None:
                hit.basis = "wrapped"
                hit.extra[:0] = list(range(i + 1, j + 1))
                return hit
        parts.append(nxt)
    return None


def _wrapped_pairs(lines: list[Line], hit_lines: set[int]) -> list[int]:
    """Lines that may continue on the next one (a terminal cut them at its width)."""
    out = []
    for i in range(len(lines) - 1):
        text, nxt = lines[i].text, lines[i + 1]
        if len(lines[i].raw) < MIN_WRAPPED or i in hit_lines or i + 1 in hit_lines:
            continue
        if nxt.stream != lines[i].stream and nxt.stream != _NO_STREAM:
            continue   # the next line is another process's: not a continuation
        window = text[-_LONGEST_NEEDLE:] + nxt.text.lstrip()[:_LONGEST_NEEDLE]
        window2 = text[-_LONGEST_NEEDLE:].rstrip() + " " + nxt.text.lstrip()[:_LONGEST_NEEDLE]
        if _NEEDLE_RE.search(window) or _NEEDLE_RE.search(window2):
            out.append(i)
    return out


def _match(lines: list[Line], i: int, text: str) -> Hit | None:
    line = lines[i]
    for sig in SIGNATURES:
        m = sig.pattern.search(text)
        if m is None or (sig.exclude is not None and sig.exclude.search(text)):
            continue
        fields = {k: v for k, v in m.groupdict().items() if v is not None}
        # `subject_rank`: the message is about that rank, whoever printed it (rank 0's
        # stall watchdog, also quoted in torchrun's summary under rank 0's name)
        rank = int(fields["subject_rank"]) if "subject_rank" in fields else line.rank
        if rank is None and "hit_rank" in fields:   # e.g. mp.spawn's "process 1 ..."
            rank = int(fields["hit_rank"])
        hit = Hit(sig.cause, sig.strength, i, rank, sig, fields)
        _follow(hit, lines)
        return hit
    return None


def _follow(hit: Hit, lines: list[Line]) -> None:
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


def exception_hits(lines: list[Line], events: list[ExceptionEvent],
                   hits: list[Hit]) -> list[Hit]:
    """A hit for each exception no signature explains: a framework cause, else the user's.

    A signature on the exception's line, or on the lines right after it (its message
    continued, or wrapped by a terminal), explains it; the process's own teardown abort
    right after it (`terminate called without an active exception`) never does: that is
    the exception's consequence (`demote_consequences`), whatever prefixes the lines carry.
    """
    causes = [h for h in hits if h.cause not in TEARDOWN]
    explained = {h.line for h in causes} | {j for h in causes for j in h.extra}
    out = []
    for ev in events:
        if WRAPPER_EXCEPTIONS.search(ev.type) or WRAPPER_MESSAGES.match(ev.message):
            continue
        stream = lines[ev.line].stream
        # the message may continue on the next lines of the same process (or, wrapped by
        # a terminal, on lines that lost the prefix)
        span = [j for j in range(ev.line, min(len(lines), ev.line + 6))
                if lines[j].stream == stream or _continues(lines, j)]
        if any(j in explained for j in span) or _carrier(ev):
            continue
        framework = _framework_cause(ev)
        frame = user_frame(ev)
        where = f"{frame[0]}:{frame[1]} in {frame[2]}" if frame else "see the traceback"
        extra = [frame[3]] if frame else []
        if frame and frame[3] + 1 < len(lines) and lines[frame[3] + 1].stream == stream:
            extra.append(frame[3] + 1)
        msg = ev.message if len(ev.message) <= 200 else ev.message[:197] + "..."
        fields = {"exc_type": ev.type, "exc_msg": msg or "(no message)", "where": where}
        if framework is not None:
            cause, strength = framework
            inner = ev.frames[-1][3] if ev.frames else None
            out.append(Hit(cause, strength, ev.line, lines[ev.line].rank, None, fields,
                           [inner] if inner is not None else [], basis="frames"))
            continue
        out.append(Hit("user_code_error", RANK, ev.line, lines[ev.line].rank, None, fields,
                       extra, basis="exception"))
    return out


def _continues(lines: list[Line], j: int) -> bool:
    """Line j is the unprefixed rest of a long line the terminal wrapped."""
    return (j > 0 and lines[j].stream == _NO_STREAM and lines[j - 1].stream != _NO_STREAM
            and len(lines[j - 1].raw) >= MIN_WRAPPED)


def _carrier(ev: ExceptionEvent) -> bool:
    """An exception that only reports a failure the framework or launcher saw elsewhere."""
    if _FRAMEWORK_CARRIERS.search(ev.message):
        return True
    return ev.type.endswith("CalledProcessError") and any(
        _LAUNCHER_FRAMES.search(f[0].replace("\\", "/")) for f in ev.frames)


def _framework_cause(ev: ExceptionEvent) -> tuple[str, int] | None:
    """The cause of an exception raised by torch's own setup code, read from its frames."""
    paths = [(f[0].replace("\\", "/"), f[2]) for f in ev.frames]
    text = f"{ev.type}: {ev.message}"
    if _SHM_ERRNO.search(text) and any(_SHM_FRAMES.search(p) or _SHM_FUNCS.search(fn)
                                       for p, fn in paths):
        return "shm_too_small", ROOT
    if ev.type.endswith(("DistStoreError", "DistNetworkError")):
        return "rendezvous_failure", LIKELY
    if not paths or not _FRAMEWORK_TYPES.search(ev.type):
        return None
    inner_path, _ = paths[-1]
    if _RDZV_FRAMES.search(inner_path) and any(_RDZV_FUNCS.match(fn) for _, fn in paths):
        return "rendezvous_failure", RANK   # raised while the group formed: not user code
    return None


def record_hits(records: list[FailureRecord], lines: list[Line],
                events: list[ExceptionEvent]) -> list[Hit]:
    """Evidence in torchrun's exit records: SIGBUS, and a deliberate exit code."""
    out = []
    raised = {lines[ev.line].rank for ev in events if not WRAPPER_EXCEPTIONS.search(ev.type)}
    for rec in records:
        if not rec.root:
            continue
        line = rec.lines[-1] if rec.lines else rec.first_line
        if rec.signal == "SIGBUS":
            out.append(Hit("shm_too_small", RANK, line, rec.rank, None,
                           {"detail": " (a worker died of SIGBUS)"}, basis="record"))
        elif (rec.exitcode is not None and 2 <= rec.exitcode <= 125 and rec.rank not in raised
              and _EXIT_NO_TRACE.search(_traceback_field(rec, lines))):
            out.append(Hit("user_code_error", RANK, line, rec.rank, None,
                           {"exit_code": str(rec.exitcode)}, basis="record"))
    return out


def _traceback_field(rec: FailureRecord, lines: list[Line]) -> str:
    for i in rec.lines:
        m = re.match(r"^\s*traceback\s*:\s?(.*)$", lines[i].text)
        if m:
            return m.group(1).strip()
    return ""


def demote_consequences(hits: list[Hit], lines: list[Line],
                        events: list[ExceptionEvent]) -> None:
    """A C++ abort after the same rank's Python exception is teardown, not the cause."""
    raised = [(lines[ev.line].stream, lines[ev.line].rank, ev.line) for ev in events
              if not WRAPPER_EXCEPTIONS.search(ev.type)]
    for hit in hits:
        if hit.cause not in TEARDOWN:
            continue
        stream = lines[hit.line].stream
        if any(at < hit.line and (s == stream or (r is not None and r == hit.rank)
                                  or (hit.rank is None and hit.line - at <= 20))
               for s, r, at in raised):
            hit.strength = CONSEQUENCE
