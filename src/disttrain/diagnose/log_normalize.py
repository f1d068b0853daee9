"""Undo what pasting does to a log before it is read: escaped JSON, the doctor's own echo.

Users paste what they have: torchrun's error file (`error.json`, a traceback escaped
inside a JSON string: `"py_callstack": "Traceback ...\\n  File ...\\n"`), or the output
of `disttrain run ... 2>&1 | tee job.log`, which already ends with an earlier diagnosis.
Reading that diagnosis again would double the evidence and could move the blamed rank,
so it is dropped; an escaped traceback is unfolded into the lines it stood for, each
keeping the prefix (`[rank1]:`, `[pod/x/c] `) of the line that carried it.
"""

from __future__ import annotations

import re

from disttrain.diagnose.log_parse import strip_prefixes

# The blocks `format_diagnosis` prints (logs.py): they are this tool's output, not the job's.
_DOCTOR_HEAD = re.compile(r"^cause: [a-z_]+ - ")
_DOCTOR_BODY = re.compile(
    r"^(?:where: (?:rank \d+|host )|evidence:$|  \| |then \(consequences, not the cause\): |"
    r"confidence: |fix: |     \S)")
_ESCAPED_NEWLINE = re.compile(r"(?<!\\)\\n")
_ESCAPES = {"\\\"": "\"", "\\t": "\t", "\\\\": "\\", "\\/": "/"}
_ESCAPE_RUN = re.compile(r"\\[\"t\\/]")
_UNESCAPE_MARKERS = ("Traceback (most recent call last):", "Error", "Exception", "py_callstack")


def normalize(text: str) -> str:
    """The log as the processes wrote it: doctor output removed, JSON strings unfolded."""
    if "\\n" not in text and "cause: " not in text:
        return text
    out: list[str] = []
    in_doctor = False
    for line in text.splitlines():
        if in_doctor:
            if _DOCTOR_BODY.match(line):
                continue
            in_doctor = False
        if line.startswith("cause: ") and _DOCTOR_HEAD.match(line):
            in_doctor = True
            continue
        if "\\n" in line and line.count("\\n") >= 2 and any(m in line for m in _UNESCAPE_MARKERS):
            out += _unfold(line)
        else:
            out.append(line)
    return "\n".join(out)


def _unfold(line: str) -> list[str]:
    """One line holding an escaped multi-line string -> the lines it stands for."""
    text = strip_prefixes(0, line).text
    prefix = line[:len(line) - len(text)]
    body = line[len(prefix):]
    pieces = _ESCAPED_NEWLINE.split(body)
    return [prefix + _ESCAPE_RUN.sub(lambda m: _ESCAPES[m.group(0)], p) for p in pieces]
