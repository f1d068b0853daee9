#!/usr/bin/env python3
"""`uv pip install` into this interpreter's environment, from the package sources pip is
configured with (the Makefile's installs).

    .venv/bin/python tools/uv_install.py -c constraints.txt -e '.[test]'

Why: the Makefile installs torch with pip, whose configuration may point it at a wheel on
local disk (and cap its version), then everything else with uv, which installed the ~100
packages of the test extras in ~4 s where pip took ~35 s on the 2-core machine this project
is tested on (README, Development). uv reads no pip.conf and no PIP_* variable
(https://docs.astral.sh/uv/pip/compatibility/), so a mirror set up for pip would be passed
over; this hands pip's index-url, extra-index-url, find-links, no-index, trusted-host,
constraint and cert to uv. pip takes the best version over all its sources, so with more
than one uv is asked to do the same (`--index-strategy unsafe-best-match`; uv's default
takes a package from the first index that has it).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's setting -> uv's flag, for the settings that say where packages come from and how
# to reach them (`cert`, a mirror's CA bundle, is uv's SSL_CERT_FILE: `uv_env`)
SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "no-index": "--no-index",
           "trusted-host": "--allow-insecure-host",
           "constraint": "--constraint"}   # the machine's caps (a pip.conf may hold one)
# which of pip's configuration sections wins (`pip install` reads [global] and [install];
# PIP_* variables, shown by `pip config list` as ":env:", override both)
PRECEDENCE = (":env:", "install", "global")
TRUE = {"1", "true", "yes", "on"}


def parse_config_list(text: str) -> dict[str, str]:
    """`pip config list` output (`section.key='value'` lines) -> {key: the value that wins}."""
    best: dict[str, tuple[int, str]] = {}   # key -> (its section's place in PRECEDENCE, value)
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not (sep and dot) or section not in PRECEDENCE:
            continue
        try:
            value = str(ast.literal_eval(value.strip()))   # pip prints repr()
        except (ValueError, SyntaxError):
            value = value.strip()
        place = PRECEDENCE.index(section)
        if key not in best or place < best[key][0]:
            best[key] = (place, value)
    return {key: value for key, (_, value) in best.items()}


def uv_source_flags(settings: dict[str, str]) -> list[str]:
    """uv flags for pip's package sources (none: uv's default, PyPI)."""
    flags: list[str] = []
    for key, flag in SOURCES.items():
        value = settings.get(key, "").strip()
        if not value:
            continue
        if key == "no-index":
            if value.lower() in TRUE:
                flags.append(flag)
            continue
        for item in value.split():   # pip's lists: whitespace or one per line
            flags += [flag, item]
    if any(f in ("--extra-index-url", "--find-links") for f in flags):
        flags += ["--index-strategy", "unsafe-best-match"]
    return flags


def uv_env(settings: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """The environment uv runs in: pip's CA bundle where none is set, no progress bars."""
    env = {**environ, "UV_NO_PROGRESS": "1"}
    if settings.get("cert") and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = settings["cert"]
    return env


def pip_settings() -> dict[str, str]:
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False)
    return parse_config_list(res.stdout) if res.returncode == 0 else {}


def main(argv: list[str]) -> int:
    settings = pip_settings()
    cmd = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable,
           *uv_source_flags(settings), *argv]
    return subprocess.run(cmd, env=uv_env(settings, dict(os.environ)), check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
