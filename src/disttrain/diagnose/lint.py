"""`disttrain lint`: check a training script against the DDP checklist, statically.

    disttrain lint train.py                     # path:line: DT004 message / fix
    disttrain lint --json a.py scripts/         # {"findings": [{"rule","path","line",...}], ...}
    x = 1  # disttrain: ignore[DT005]           # silence one rule on one line

    findings = lint_paths(["train.py"])         # raises LintError for unreadable input

The checklist of a correct DDP script, and the errors a wrong one ends in, turned into AST
rules with stable ids: DT001-005 in rules_checklist.py, DT006-010 in rules_sync.py,
DT011-018 in rules_pitfalls.py, DT019-023 in rules_scripts.py, registered through
lint_registry.py; see RULES and
docs/troubleshooting.md. Nothing is executed and torch is not
imported: linting answers in milliseconds on a laptop without GPUs. Rules prefer
silence to guessing: each one fires only on a pattern it can name precisely.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.diagnose import (  # noqa: F401  (registers the rules)
    rules_checklist,
    rules_pitfalls,
    rules_scripts,
    rules_sync,
)
from disttrain.diagnose.lint_ctx import ScriptInfo
from disttrain.diagnose.lint_registry import CHECKS, RULES, Rule
from disttrain.errors import LintError
from disttrain.spec.paths import check_readable_file

__all__ = ["RULES", "Finding", "LintError", "LintReport", "Rule", "expand_paths",
           "format_findings", "format_report", "lint_paths", "lint_report", "lint_source"]

_IGNORE = re.compile(r"#\s*disttrain:\s*ignore(?:\[(?P<rules>[A-Za-z0-9_,\s]*)\])?")
# non-Python launch files: only the text rule applies (python -m torch.distributed.launch)
TEXT_SUFFIXES = (".sh", ".bash", ".yaml", ".yml")
_LAUNCH_TEXT = re.compile(r"torch\.distributed\.launch\b")



@dataclass(frozen=True)
class Finding:
    """One rule violation: rule id, where, what is wrong and how to fix it."""

    rule: str
    path: str
    line: int
    message: str
    fix: str
    end_line: int = field(default=0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The `--format json` shape: rule, path, line, message, fix."""
        return {"rule": self.rule, "path": self.path, "line": self.line,
                "message": self.message, "fix": self.fix}


def lint_source(source: str, path: str = "<string>", select: Iterable[str] | None = None,
                ignore: Iterable[str] | None = None) -> list[Finding]:
    """Findings for one script's source, sorted by line.

    Args:
        source: the script's text.
        path: the name shown in findings.
        select: only these rule ids (default: all).
        ignore: never these rule ids.

    Raises:
        LintError: the source is not valid Python (the message names file and line).

    Example:
        >>> [f.rule for f in lint_source("import torch\\nm = torch.nn.DataParallel(net)\\n")]
        ['DT001']
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else path
        raise LintError(f"{where}: cannot parse the script: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise LintError(f"{path}: cannot parse the script: {exc}") from None
    try:
        found = _run_checks(ScriptInfo(tree, source, path), path, _wanted(select, ignore))
    except RecursionError:
        raise LintError(f"{path}: the script is too deeply nested to analyse") from None
    silenced = _ignore_comments(source)
    out = [f for f in found.values() if not _is_silenced(f, silenced)]
    return sorted(out, key=lambda f: (f.line, f.rule))


def _run_checks(info: ScriptInfo, path: str, wanted: set[str]) -> dict[tuple[str, int], Finding]:
    found: dict[tuple[str, int], Finding] = {}
    for rule_id, check in CHECKS.items():
        if rule_id not in wanted:
            continue
        for node, message, fix in check(info):
            line = getattr(node, "lineno", 1)
            key = (rule_id, line)
            if key not in found:   # one finding per rule and line
                found[key] = Finding(rule_id, path, line, message, fix or RULES[rule_id].fix,
                                     _span_end(node, line))
    return found


def lint_text(text: str, path: str) -> list[Finding]:
    """Launch scripts and manifests: only DT008 (torch.distributed.launch) applies."""
    out = []
    for no, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip()
        if stripped.startswith("#") or not _LAUNCH_TEXT.search(line):
            continue
        if _ignore_line(line, "DT008"):
            continue
        rule = RULES["DT008"]
        out.append(Finding("DT008", path, no, "launches with `python -m torch.distributed."
                           "launch`, which is deprecated and passes --local-rank as an "
                           "argument", rule.fix, no))
    return out


def lint_paths(paths: Iterable[str | Path], select: Iterable[str] | None = None,
               ignore: Iterable[str] | None = None) -> list[Finding]:
    """Findings for several files; every file is read and parsed before any is linted.

    Raises:
        LintError: a file is missing, unreadable, not UTF-8 or not valid Python.
    """
    out: list[Finding] = []
    for name, text, tree in _read_all(paths):
        if tree is not None:
            out += lint_source(text, name, select, ignore)
        elif "DT008" in _wanted(select, ignore):
            out += lint_text(text, name)
    return out


def _read_all(paths: Iterable[str | Path]) -> list[tuple[str, str, ast.Module | None]]:
    """(name, text, tree; None for launch scripts and manifests) of every file, or the
    LintError of the first that cannot be read or parsed."""
    sources = []
    for p in paths:
        try:  # checked first: a too-long name, a NUL or a FIFO must not crash or hang
            data = check_readable_file(p, kind="script", error=LintError).read_bytes()
        except OSError as exc:  # gone or changed since the check
            raise LintError(f"{p}: cannot read: {exc.strerror or exc}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise LintError(f"{p}: not UTF-8 text (byte {exc.start})") from None
        sources.append((str(p), text))
    parsed: list[tuple[str, str, ast.Module | None]] = []
    for name, text in sources:
        if name.endswith(TEXT_SUFFIXES):
            parsed.append((name, text, None))
            continue
        try:
            parsed.append((name, text, ast.parse(text, filename=name)))
        except SyntaxError as exc:
            where = f"{name}:{exc.lineno}" if exc.lineno else name
            raise LintError(f"{where}: cannot parse the script: {exc.msg}") from None
        except (ValueError, RecursionError, MemoryError) as exc:
            raise LintError(f"{name}: cannot parse the script: {exc}") from None
    return parsed


@dataclass
class LintReport:
    """What `disttrain lint` found: findings, the files it linted and those it skipped."""

    findings: list[Finding]
    linted: list[str]
    skipped: list[tuple[str, str]]   # (path, why)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` shape: {findings: [...], linted: [...], skipped: [{path, reason}], ok}."""
        return {"findings": [f.to_dict() for f in self.findings], "linted": self.linted,
                "skipped": [{"path": p, "reason": r} for p, r in self.skipped],
                "ok": not self.findings}


_SKIP_DIRS = ("__pycache__", "site-packages", "node_modules")
NOT_DISTRIBUTED = ("not a distributed script (no process group, DDP/FSDP, DistributedSampler, "
                   "DataParallel, RPC or launcher); --all lints it anyway")


def expand_paths(paths: Iterable[str | Path]) -> list[str]:
    """Files as given, and for a directory its *.py files, recursively and sorted,
    skipping hidden folders, __pycache__ and virtual environments (a pyvenv.cfg).

    Raises:
        LintError: a directory holds no Python file.
    """
    out: list[str] = []
    for p in paths:
        if not os.path.isdir(p):
            out.append(str(p))
            continue
        found = []
        for root, dirs, files in os.walk(p):   # does not follow symlinked folders
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS
                             and not os.path.exists(os.path.join(root, d, "pyvenv.cfg")))
            found += [os.path.join(root, f) for f in sorted(files)
                      if f.endswith(".py") and not f.startswith(".")]
        if not found:
            raise LintError(f"{p}: is a directory with no Python file in it (hidden folders, "
                            f"__pycache__ and virtual environments are skipped); give a script "
                            f"or a folder of scripts")
        out += found
    return out


def lint_report(paths: Iterable[str | Path], select: Iterable[str] | None = None,
                ignore: Iterable[str] | None = None, all_files: bool = False) -> LintReport:
    """`disttrain lint PATH...`: directories recursed, non-distributed scripts skipped
    (unless `all_files`), every file read and parsed before any is linted.

    Raises:
        LintError: a path is missing, unreadable, not UTF-8 or not valid Python.
    """
    linted: list[str] = []
    skipped: list[tuple[str, str]] = []
    findings: list[Finding] = []
    for name, text, tree in _read_all(expand_paths(paths)):   # bad input fails first
        if tree is None:
            if "DT008" in _wanted(select, ignore):
                findings += lint_text(text, name)
        elif all_files or ScriptInfo(tree, text).looks_distributed():
            findings += lint_source(text, name, select, ignore)
        else:
            skipped.append((name, NOT_DISTRIBUTED))
            continue
        linted.append(name)
    return LintReport(findings, linted, skipped)


def format_report(report: LintReport) -> str:
    """The findings, a line per skipped file, and the summary."""
    lines = [format_findings(report.findings)]
    summary = lines.pop()
    lines += [f"skipped {p}: {why}" for p, why in report.skipped]
    if report.skipped:
        summary += f"; {len(report.skipped)} file(s) skipped"
    return "\n".join([*lines, summary])


def format_findings(findings: list[Finding]) -> str:
    """path:line: RULE message, then the fix, indented; a summary line at the end."""
    lines = []
    for f in findings:
        lines.append(f"{f.path}:{f.line}: {f.rule} {f.message}")
        lines.append(f"    fix: {f.fix}")
    files = len({f.path for f in findings})
    lines.append(f"{len(findings)} finding(s) in {files} file(s)" if findings
                 else "no findings")
    return "\n".join(lines)


def _wanted(select: Iterable[str] | None, ignore: Iterable[str] | None) -> set[str]:
    wanted = {r.upper() for r in select} if select else set(RULES)
    return wanted - {r.upper() for r in (ignore or ())}


def _span_end(node: ast.AST, line: int) -> int:
    """Last line an ignore comment may sit on: a call's last line, a block's header."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and hasattr(body[0], "lineno"):
        return max(line, body[0].lineno - 1)
    return getattr(node, "end_lineno", None) or line


def _ignore_comments(source: str) -> dict[int, set[str] | None]:
    """line -> rule ids silenced there (None: every rule)."""
    out: dict[int, set[str] | None] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type == tokenize.COMMENT and _IGNORE.search(tok.string):
            out[tok.start[0]] = _silenced_rules(tok.string)
    return out


def _silenced_rules(comment: str) -> set[str] | None:
    """Rule ids of every `disttrain: ignore[...]` in a comment; None for a bare ignore."""
    rules: set[str] = set()
    for m in _IGNORE.finditer(comment):
        if m.group("rules") is None:
            return None
        rules |= {r.strip().upper() for r in m.group("rules").split(",") if r.strip()}
    return rules


def _is_silenced(f: Finding, silenced: dict[int, set[str] | None]) -> bool:
    """An ignore comment on any line of the flagged statement silences it."""
    for line in range(f.line, max(f.line, f.end_line) + 1):
        if line in silenced:
            rules = silenced[line]
            if rules is None or f.rule in rules:
                return True
    return False


def _ignore_line(line: str, rule: str) -> bool:
    if "#" not in line or not _IGNORE.search(line):
        return False
    rules = _silenced_rules(line[line.index("#"):])
    return rules is None or rule in rules
