"""The failure signatures `disttrain doctor logs` knows, and the line classes it needs.

The signatures live by topic in `log_rules_net` (port, rendezvous, NCCL/gloo links,
timeouts), `log_rules_hami` (a HAMi vGPU slice at its limit) and `log_rules_host` (GPUs,
builds, memory, /dev/shm, DDP, dying ranks); their
order here matters, because the first signature matching a line decides for that line:
the most specific messages come first. tests/diagnose/logs/README.md says where each
fixture's text came from.
"""

from __future__ import annotations

import re

from disttrain.diagnose.log_causes import CAUSES as BASE_CAUSES
from disttrain.diagnose.log_causes import FIELD_DEFAULTS
from disttrain.diagnose.log_rules_hami import HAMI_CAUSES, HAMI_RULES
from disttrain.diagnose.log_rules_host import DEATH_RULES, DEVICE_RULES
from disttrain.diagnose.log_rules_net import NETWORK_RULES, PORT_RULES
from disttrain.diagnose.log_signature import (
    CONSEQUENCE,
    LIKELY,
    RANK,
    ROOT,
    Signature,
    leading_literals,
)

__all__ = ["CAUSES", "CONSEQUENCE", "FAILURE_SIGNAL", "FIELD_DEFAULTS", "LIKELY", "NEEDLES",
           "RANK", "ROOT", "SIGNATURES", "TRAINING_MARKER", "UNFILTERED",
           "WRAPPER_EXCEPTIONS", "WRAPPER_MESSAGES", "Signature", "leading_literals"]

# HAMi's slice messages before the device rules: `Device N OOM` is the slice's, not the card's
SIGNATURES: tuple[Signature, ...] = (PORT_RULES + HAMI_RULES + DEVICE_RULES + NETWORK_RULES
                                     + DEATH_RULES)
CAUSES: dict[str, tuple[str, str]] = {**BASE_CAUSES, **HAMI_CAUSES}

NEEDLES: tuple[str, ...] = tuple(sorted({
    lit for s in SIGNATURES for lit in (leading_literals(s.pattern.pattern) or [])}))
# signatures without needles are tried on every line (none today; a test keeps it so)
UNFILTERED: tuple[Signature, ...] = tuple(
    s for s in SIGNATURES if s.pattern.flags & re.IGNORECASE
    or leading_literals(s.pattern.pattern) is None)

# A line that says something failed (used to tell "unknown" from "none").
FAILURE_SIGNAL = re.compile(
    r"Traceback \(most recent call last\)|ChildFailedError|\bFAILED\b|Segmentation fault|"
    r"core dumped|exitcode\s*:\s*-?[1-9]|[Ee]xit code:?\s*-?[1-9]|^Killed$|"
    r"\b(?:ERROR|FATAL|CRITICAL)\b|\b\w*(?:Error|Exception)\b:|\bpanic:|\bfailed\b|"
    r"\bfailure\b|\bAborted\b")
# A line that looks like training output (a clean log of a real run says "none").
TRAINING_MARKER = re.compile(
    r"\b(?:loss|epoch|step|accuracy|acc|iter(?:ation)?|samples/s|train(?:ing)?|rank\d*|"
    r"world[_ ]size|NCCL|torchrun|disttrain)\b", re.IGNORECASE)
# Exceptions that are wrappers or the launcher's own reaction, never a root cause.
WRAPPER_EXCEPTIONS = re.compile(
    r"(?:^|\.)(?:ChildFailedError|ProcessRaisedException|ProcessExitedException|"
    r"SignalException|KeyboardInterrupt|SystemExit)$")
WRAPPER_MESSAGES = re.compile(r"^Caught \w+ in DataLoader worker process \d+")
