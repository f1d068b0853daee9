"""What pasting does to a log, as functions: the property tests and the corpus table use them.

Each mangle takes a log and returns it as a user might paste it: lines wrapped at a
terminal's width, every line under one more prefix (torchrun's `[rank3]:`, `--tee`'s
`[default1]:`, kubectl `--prefix`, mpirun), another rank's lines interleaved, POSIX paths
turned into Windows ones, the start or the end cut off around the lines that matter.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PREFIXES = ("[rank3]:", "[default1]:", "[pod/trainer-0-x7k/pytorch] ", "[1,3]<stderr>:",
            "2024-05-14T09:12:40.123456789Z ")
NOISE = "[rank7]: epoch 0 step {i} loss 0.{i:04d}"


def wrap(text: str, width: int) -> str:
    """Every line longer than `width` cut into pieces, as a terminal shows it."""
    out = []
    for line in text.splitlines():
        while len(line) > width:
            out.append(line[:width])
            line = line[width:]
        out.append(line)
    return "\n".join(out) + "\n"


def prefix(text: str, which: int) -> str:
    """One more prefix in front of every line."""
    p = PREFIXES[which % len(PREFIXES)]
    return "\n".join(p + line for line in text.splitlines()) + "\n"


def interleave(text: str, every: int) -> str:
    """Another rank's progress lines between this log's lines."""
    out = []
    summary = False   # torchrun prints its summary alone, after the workers ended
    for i, line in enumerate(text.splitlines()):
        out.append(line)
        summary = summary or "ChildFailedError" in line
        if i % every == 0 and not summary:
            out.append(NOISE.format(i=i))
    return "\n".join(out) + "\n"


_PATH = re.compile(r'File "(/[^"]+)"')


def windows(text: str) -> str:
    """Traceback paths as Windows prints them."""
    return _PATH.sub(lambda m: 'File "C:' + m.group(1).replace("/", "\\") + '"', text)


def cut(text: str, keep: tuple[int, int], start: int, end: int) -> str:
    """Up to `start` lines cut before line keep[0] and `end` lines after keep[1]."""
    lines = text.splitlines()
    lo = max(0, min(start, keep[0]))
    hi = max(keep[1] + 1, len(lines) - end)
    return "\n".join(lines[lo:hi]) + "\n"


MANGLES: dict[str, Callable[[str], str]] = {
    "wrap80": lambda t: wrap(t, 80),
    "wrap120": lambda t: wrap(t, 120),
    "prefix_rank": lambda t: prefix(t, 0),
    "prefix_kubectl": lambda t: prefix(t, 2),
    "prefix_mpi": lambda t: prefix(t, 3),
    "interleave": lambda t: interleave(t, 3),
    "windows": windows,
}
