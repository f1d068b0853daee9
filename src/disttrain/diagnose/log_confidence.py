"""Which hit is the root cause, and how sure the doctor may be of it.

Choosing: the strongest signature wins; among framework-or-weaker evidence, the rank
torchrun saw fail first (its "Root Cause" record) wins; then the earliest line. A
framework cause in the failing rank's output therefore beats the `user_code_error` it
raised (the catch-all is RANK strength, below every framework cause), and the first
failure beats what it caused on the other ranks.

Grading, so that a reader knows when to look twice:

- high: a message that names its cause by itself, read whole (not across a wrapped
  line), with no equally strong rival;
- medium: a usually-right message (rendezvous, NCCL setup), a Python exception with a
  frame in the user's code, a signal in torchrun's summary (SIGBUS, SIGKILL), or a
  strong message read across a wrapped line;
- low: only what other ranks report after a failure, a framework error classified from
  its traceback's frames, an NCCL "unhandled system error" (whose cause NCCL names only
  with NCCL_DEBUG=INFO), or a rival cause as strong as the winner. A low grade names the
  other cause that is possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.diagnose.log_hits import Hit
from disttrain.diagnose.log_parse import Line
from disttrain.diagnose.log_rules import CONSEQUENCE, LIKELY, RANK, ROOT

LEVELS = ("high", "medium", "low")


@dataclass(frozen=True)
class Confidence:
    """How sure the diagnosis is, the lines that decided it, and the other possible cause."""

    level: str
    evidence: list[str] = field(default_factory=list)
    alternative: str | None = None


def select(hits: list[Hit], root_ranks: set[int]) -> Hit:
    """Strongest message; then the rank torchrun saw fail first; then the earliest line."""
    best = max(h.strength for h in hits)
    if best < ROOT and root_ranks:
        first_failing = [h for h in hits if h.strength >= RANK and h.rank in root_ranks]
        if first_failing:
            return min(first_failing, key=lambda h: (-h.strength, h.line))
    pool = [h for h in hits if h.strength == best]
    return min(pool, key=lambda h: (h.rank not in root_ranks, h.line))


def grade(winner: Hit, hits: list[Hit], lines: list[Line], root_ranks: set[int]) -> Confidence:
    """The confidence of `winner` given every other hit of the log."""
    rivals = [h for h in hits if h.cause != winner.cause and h.strength >= winner.strength
              and h.strength > CONSEQUENCE]
    rival = min(rivals, key=lambda h: h.line) if rivals else None
    level, alternative = _base(winner, hits, root_ranks)
    if rival is not None:
        level = "low" if level != "high" else "medium"
        alternative = rival.cause
    idx = [winner.line, *winner.extra[:2]]
    if rival is not None:
        idx.append(rival.line)
    evidence: list[str] = []
    for i in idx:
        text = lines[i].raw.strip()[:300]
        if text and text not in evidence:
            evidence.append(text)
    if level != "low" and rival is None:
        alternative = None
    return Confidence(level, evidence, alternative)


def _base(winner: Hit, hits: list[Hit], root_ranks: set[int]) -> tuple[str, str | None]:
    """The grade the winning hit earns on its own, and the cause it could be confused with."""
    agreeing = [h for h in hits if h.cause == winner.cause]
    if winner.strength == ROOT:
        return ("high", None) if winner.basis != "wrapped" else ("medium", None)
    if winner.strength == LIKELY:
        strong = len({h.rank for h in agreeing}) > 1 or winner.rank in root_ranks
        return ("high" if strong and winner.basis == "message" else "medium"), None
    if winner.strength == RANK:
        if winner.basis == "frames":
            return "low", "user_code_error"
        if winner.cause == "nccl_network_error":
            return "low", "shm_too_small"
        if winner.cause == "rendezvous_failure":
            return "low", "none"   # store retries: the job may still have met
        if winner.cause == "user_code_error" and winner.basis == "exception":
            found = winner.fields.get("where", "see the traceback") != "see the traceback"
            return ("medium", None) if found else ("low", "unknown")
        if winner.cause == "cpp_abort":
            return "low", "unknown"
        return "medium", None
    consequences = sorted({h.cause for h in hits} - {winner.cause})
    return "low", consequences[0] if consequences else "unknown"
