"""Turn a failed job's raw output into lines that know which rank, pod and host wrote them.

A distributed job's log is several processes' output interleaved: torchrun prefixes
worker lines with `[rank1]:` (global rank) and, with `--tee`, `[default1]:` (local rank);
`kubectl logs --prefix` adds `[pod/NAME/CONTAINER] ` and `disttrain k8s logs`
`[rank 1 NAME] ` (the pod's node rank and name), mpirun `[1,0]<stderr>:`; NCCL lines start with
`host:pid:tid [dev] NCCL`; mp.spawn announces `-- Process 1 terminated with the following
error:`. torchrun's ChildFailedError summary names every failed rank with its host, exit
code and (with @record) traceback, and marks the *first observed failure*. This module
recovers all of that so the rules in `log_rules` can say *which* rank failed first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Lines longer than this are cut before matching: a rule never needs more, and a
# pathological multi-megabyte line must not make the regexes slow.
MAX_LINE = 4000

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TIMESTAMP = re.compile(  # kubectl logs --timestamps, most log shippers
    r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s+")
_POD = re.compile(r"^\[pod/([^/\]\s]+)(?:/[^\]\s]*)?\]\s?")   # kubectl logs --prefix
_PIPE = re.compile(r"^([a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?)\s+\|\s")  # `name | line`
_RANK = re.compile(r"^\[rank(\d+)\]:\s?")                      # torchrun worker prefix
_DT_POD = re.compile(r"^\[rank \S+ ([^\]\s]+)\]\s?")               # disttrain k8s logs
_LOCAL = re.compile(r"^\[[A-Za-z_][\w-]*?(\d+)\]:\s?")          # torchrun --tee [default0]:
_MPI = re.compile(r"^\[\d+,(?:mpirank:)?(\d+)(?:,[^\]]*)?\]<std(?:out|err)>:\s?")  # mpirun
_RANK_IN_TEXT = re.compile(r"\bRank (\d+)\]")                   # ProcessGroupNCCL "[... Rank 3]"
_NCCL_HOST = re.compile(r"^([\w.-]+):\d+:\d+ \[\d+\] .*?NCCL (?:INFO|WARN)")
_SPAWN_RANK = re.compile(r"^-- Process (\d+) terminated with the following error:")

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_EXCEPTION = re.compile(
    r"^\s*(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
    r"(?:Error|Exception|Exit|Interrupt|Warning|Failure|Fault|Timeout|StopIteration))"
    r"(?::\s?(?P<msg>.*))?$")

_SUMMARY_ROOT = re.compile(r"^\s*Root Cause \(first observed failure\):")
_SUMMARY_FAILURES = re.compile(r"^\s*Failures:")
_SUMMARY_INDEX = re.compile(r"^\s*\[(\d+)\]:\s*$")
_SUMMARY_KEY = re.compile(r"^\s{1,4}(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_SUMMARY_END = re.compile(r"^\s*(?:={8,}|-{8,})\s*$")
_RANK_FIELD = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_EXIT_FIELD = re.compile(r"^(-?\d+)(?: \(pid: (\d+)\))?(?:\s+\((SIG\w+)\))?")


@dataclass
class Line:
    """One line of the log, with what its prefixes say about where it came from."""

    no: int                   # 1-based position in the input
    raw: str                  # as given (ANSI colours removed)
    text: str                 # without timestamp / pod / rank prefixes
    rank: int | None = None   # global rank, when a prefix or the summary says so
    local_rank: int | None = None
    pod: str | None = None
    host: str | None = None

    @property
    def stream(self) -> tuple[str | None, int | None, int | None]:
        """Lines of one process share a stream: tracebacks are followed per stream."""
        return (self.pod, self.rank, self.local_rank)


@dataclass
class FailureRecord:
    """One entry of torchrun's ChildFailedError summary."""

    root: bool                      # listed under "Root Cause (first observed failure)"
    first_line: int                 # index into the lines list
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    exitcode: int | None = None
    pid: int | None = None
    signal: str | None = None
    error_file: str | None = None
    time: str | None = None
    pod: str | None = None
    lines: list[int] = field(default_factory=list)   # indices of the record's lines


@dataclass
class ExceptionEvent:
    """The last line of a Python traceback: the exception a process died of."""

    line: int                       # index of the exception line
    type: str
    message: str
    frames: list[tuple[str, int, str, int]]   # (file, line, function, index of frame line)


def split_lines(text: str) -> list[Line]:
    """Split and strip prefixes; `\\r` counts as a line break (progress bars)."""
    lines: list[Line] = []
    spawn_rank: int | None = None
    for no, raw in enumerate(text.splitlines(), start=1):
        raw = _ANSI.sub("", raw)[:MAX_LINE]
        line = strip_prefixes(no, raw)
        text = line.text
        if text.startswith("-- Process") and line.rank is None:
            m = _SPAWN_RANK.match(text)
            spawn_rank = int(m.group(1)) if m else spawn_rank
        if line.rank is None and line.local_rank is None and spawn_rank is not None:
            line.rank = spawn_rank   # mp.spawn: this process's traceback follows the marker
        if line.rank is None and "Rank " in text:
            m = _RANK_IN_TEXT.search(text)
            if m:
                line.rank = int(m.group(1))
        if "NCCL" in text:
            m = _NCCL_HOST.match(text)
            if m:
                line.host = m.group(1)
        lines.append(line)
    return lines


def strip_prefixes(no: int, raw: str) -> Line:
    """One raw line as a Line: the prefixes removed, and what they said kept."""
    line = Line(no=no, raw=raw, text=raw)
    text = raw
    for _ in range(6):  # prefixes nest: [pod/x/c] 2024-...Z [default1]:[rank1]: ...
        first = text[:1]
        if first.isdigit():
            m = _TIMESTAMP.match(text)
            if m:
                text = text[m.end():]
                continue
        if first == "[":
            m = (_POD.match(text) if text.startswith("[pod/") else
                 _DT_POD.match(text) if text.startswith("[rank ") else None)
            if m and line.pod is None:
                line.pod = m.group(1)
                text = text[m.end():]
                continue
            m = _RANK.match(text) if text.startswith("[rank") else None
            if m:
                line.rank = int(m.group(1))
                text = text[m.end():]
                continue
            m = _LOCAL.match(text)
            if m:
                line.local_rank = int(m.group(1))
                text = text[m.end():]
                continue
            m = _MPI.match(text) if "]<std" in text[:40] else None
            if m:
                line.rank = int(m.group(1))
                text = text[m.end():]
                continue
        elif line.pod is None and " | " in text[:70]:
            m = _PIPE.match(text)
            if m:
                line.pod = m.group(1)
                text = text[m.end():]
                continue
        break
    line.text = text
    return line


def parse_summary(lines: list[Line]) -> list[FailureRecord]:
    """torchrun's ChildFailedError table: every failed rank, and which failed first.

    Lines inside a record get the record's rank and host, so a rule matching the
    record's traceback (present when the script uses @record) is attributed correctly.
    """
    records: list[FailureRecord] = []
    root = False
    current: FailureRecord | None = None
    last_key = ""
    for i, line in enumerate(lines):
        text = line.text
        lead = text.lstrip()[:1]
        if lead == "R" and _SUMMARY_ROOT.match(text):
            root, current = True, None
            continue
        if lead == "F" and _SUMMARY_FAILURES.match(text):
            root, current = False, None
            continue
        if lead in ("=", "-") and _SUMMARY_END.match(text):
            current = None
            continue
        m = _SUMMARY_INDEX.match(text) if lead == "[" else None
        if m and i + 1 < len(lines) and _SUMMARY_KEY.match(lines[i + 1].text):
            current = FailureRecord(root=root, first_line=i, pod=line.pod)
            records.append(current)
            current.lines.append(i)
            continue
        if current is None:
            continue
        m = _SUMMARY_KEY.match(text)
        if m:
            last_key = m.group(1)
            _set_field(current, last_key, m.group(2).strip())
            current.lines.append(i)
        elif last_key == "traceback" and (text.startswith("  ") or not text.strip()):
            current.lines.append(i)
        else:
            current = None
    for rec in records:
        for i in rec.lines:
            if rec.rank is not None:
                lines[i].rank = rec.rank
            lines[i].host = rec.host or lines[i].host
    return records


def _set_field(rec: FailureRecord, key: str, value: str) -> None:
    if key == "time":
        rec.time = value
    elif key == "host":
        rec.host = value or None
    elif key == "rank":
        m = _RANK_FIELD.match(value)
        if m:
            rec.rank, rec.local_rank = int(m.group(1)), int(m.group(2))
    elif key == "exitcode":
        m = _EXIT_FIELD.match(value)
        if m:
            rec.exitcode = int(m.group(1))
            rec.pid = int(m.group(2)) if m.group(2) else None
            rec.signal = m.group(3)
    elif key == "error_file":
        rec.error_file = None if value in ("", "<N/A>") else value
    elif key == "traceback":
        m = re.search(r"Signal \d+ \((SIG\w+)\)", value)
        if m and not rec.signal:
            rec.signal = m.group(1)


def find_exceptions(lines: list[Line]) -> list[ExceptionEvent]:
    """Every traceback's final exception, followed per process so interleaving is harmless.

    Inside torchrun's summary (`traceback : Traceback ...`) frames are indented by four
    and the exception by two spaces; elsewhere the exception line is not indented. A
    `File "...", line N` frame opens a traceback even without its header line: pasted
    excerpts often start inside one.
    """
    open_tb: dict[tuple[str | None, int | None, int | None],
                  tuple[list[tuple[str, int, str, int]], bool]] = {}
    events: list[ExceptionEvent] = []
    for i, line in enumerate(lines):
        key = line.stream
        text = line.text
        if "Traceback (most recent call last" in text:   # "):" may be wrapped off
            open_tb[key] = ([], bool(re.match(r"^\s*traceback\s*:", text)))
            continue
        m = _FRAME.match(text) if "File \"" in text else None
        if key not in open_tb:
            if m is None:
                continue
            open_tb[key] = ([], False)   # an excerpt that starts inside a traceback
        frames, in_summary = open_tb[key]
        if m:
            frames.append((m.group("file"), int(m.group("line")), m.group("func").strip(), i))
            continue
        indent = len(text) - len(text.lstrip())
        if not text.strip() or indent > (2 if in_summary else 0):
            continue   # source lines, carets, blank lines inside the traceback
        m = _EXCEPTION.match(text)
        if m:
            events.append(ExceptionEvent(i, m.group("type"), (m.group("msg") or "").strip(),
                                         frames))
        del open_tb[key]
    return events


# disttrain's own modules, also from a source checkout (`src/disttrain/train/checkpoint.py`):
# an error raised there names the user's input in its message, never a line to fix there.
_DISTTRAIN_FRAME = re.compile(
    r"/disttrain/(?:(?:train|distributed|launch|resilience|monitor|diagnose|spec|k8s|verify|"
    r"bench|cli|examples|recipes)/\w+|worker|fit|testing|rundir|envvars)\.py$")


def user_frame(event: ExceptionEvent) -> tuple[str, int, str, int] | None:
    """The innermost frame in the user's own code (not torch, not the stdlib, not disttrain)."""
    for frame in reversed(event.frames):
        path = frame[0].replace("\\", "/")   # Windows paths read like POSIX ones
        if ("site-packages" in path or "dist-packages" in path or path.startswith("<")
                or _DISTTRAIN_FRAME.search(path)
                or re.search(r"/lib/python3\.?\d+/|^[A-Za-z]:/Python3\d+/Lib/", path,
                             re.IGNORECASE)):
            continue
        return frame
    return None
