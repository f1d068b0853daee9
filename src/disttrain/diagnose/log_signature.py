"""One failure signature of `disttrain doctor logs`, and the literal prefilter that keeps it fast.

A signature is a message that torch, NCCL, gloo, CUDA or HAMi really prints, with the
cause it means and how strongly it names that cause, because a failed job usually shows
several errors and only one of them is the cause:

    ROOT (4)        names a cause on its own (CUDA OOM, port in use, DDP misuse, ...);
    LIKELY (3)      usually the cause, but can follow another failure (rendezvous, NCCL
                    interface/connect errors);
    RANK (2)        a rank died (its own exception, SIGKILL); the root cause when
                    nothing stronger is seen;
    CONSEQUENCE (1) what the *other* ranks report once one rank is gone: "Connection
                    closed by peer", watchdog / gloo timeouts, closed rendezvous.

Every signature's pattern starts with literal text (`leading_literals`), so the doctor
finds the few lines worth running regexes on with plain substring searches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROOT, LIKELY, RANK, CONSEQUENCE = 4, 3, 2, 1


@dataclass(frozen=True)
class Signature:
    """One real message: which cause it means, how strongly, and a sharper title/fix."""

    cause: str
    strength: int
    pattern: re.Pattern[str]
    title: str | None = None
    fix: str | None = None
    exclude: re.Pattern[str] | None = None
    # lines shortly after the match that add detail (e.g. which parameters got no grad)
    follow: tuple[re.Pattern[str], ...] = field(default_factory=tuple)


def sig(cause: str, strength: int, pattern: str, title: str | None = None,
        fix: str | None = None, exclude: str | None = None, follow: tuple[str, ...] = (),
        flags: int = 0) -> Signature:
    """A Signature from plain strings (the tables in log_rules_* read best that way)."""
    return Signature(cause, strength, re.compile(pattern, flags), title, fix,
                     re.compile(exclude) if exclude else None,
                     tuple(re.compile(f) for f in follow))


def leading_literals(pattern: str) -> list[str] | None:
    """The literal text each top-level alternative of `pattern` must start with.

    A line can only match when it contains one of them, so a plain substring search over
    the whole log finds the few lines worth running the regexes on. None when some
    alternative starts with no literal of three or more characters.
    """
    branches, depth, cur, i = [], 0, "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            cur += pattern[i:i + 2]
            i += 2
            continue
        depth += c == "("
        depth -= c == ")"
        if c == "|" and depth == 0:
            branches.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    branches.append(cur)
    out = []
    for branch in branches:
        lit = _literal_prefix(branch)
        if len(lit) < 3:
            return None
        out.append(lit)
    return out


def _literal_prefix(branch: str) -> str:
    b = branch.removeprefix("^")
    b = b[2:] if b.startswith("\\b") else b
    lit, i = "", 0
    while i < len(b):
        c = b[i]
        if c == "\\":
            if i + 1 < len(b) and not b[i + 1].isalnum():
                lit += b[i + 1]
                i += 2
                continue
            break
        if c in ".^$*+?{}[]|()":
            if c in "*?{" and lit:   # the last character is optional or repeated
                lit = lit[:-1]
            break
        lit += c
        i += 1
    return lit


