"""`disttrain lint`: check training scripts against the distributed-training checklist.

    disttrain lint train.py [DIR ...] [--json] [--select DT004,DT007] [--ignore DT005] [--all]
    disttrain lint --list-rules

A directory is searched for *.py files (hidden folders, __pycache__ and virtual
environments skipped); files with nothing distributed in them (model definitions, data
helpers) are skipped with a note unless --all. Exit codes: 0 no findings, 1 findings, 2 bad
input (an unreadable file, a script that does not parse, an unknown rule id) with one
`error:` line. The rules themselves live in `disttrain.diagnose` (lint.py, rules_*.py);
this module only parses and prints.
"""

from __future__ import annotations

import json
import sys

import click

from disttrain.cli.options import CTX, fail


def _rule_list(value: str | None) -> list[str] | None:
    """`--select/--ignore DT004,dt007` -> upper-case ids; an unknown id is bad input."""
    if not value:
        return None
    from disttrain.diagnose.lint import RULES

    ids = [v.strip().upper() for v in value.split(",") if v.strip()]
    unknown = [i for i in ids if i not in RULES]
    if unknown:
        fail(f"unknown rule id(s) {', '.join(unknown)}; see `disttrain lint --list-rules`")
    return ids


@click.command(context_settings=CTX)
@click.argument("scripts", nargs=-1)
@click.option("--json", "as_json", is_flag=True,
              help="print {findings: [{rule, path, line, message, fix}], linted, skipped, ok}")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="output format (json: the same as --json)")
@click.option("--select", default=None, help="only these rules, e.g. DT004,DT007")
@click.option("--ignore", "ignore_rules", default=None, help="skip these rules")
@click.option("--all", "all_files", is_flag=True,
              help="lint files with nothing distributed in them too")
@click.option("--list-rules", is_flag=True, help="print the rules and exit")
def lint(scripts: tuple[str, ...], as_json: bool, fmt: str, select: str | None,
         ignore_rules: str | None, all_files: bool, list_rules: bool) -> None:
    """Check training scripts (files or directories) against the distributed-training
    checklist (DT001...).

    `# disttrain: ignore[DT004]` on a line silences that rule there. Exit 1 when there
    are findings."""
    from disttrain.diagnose.lint import RULES, format_report, lint_report
    from disttrain.errors import LintError

    if list_rules:
        for r in RULES.values():
            click.echo(f"{r.id}  {r.name:26s} {r.summary}")
        return
    if not scripts:
        fail("give at least one SCRIPT or DIR to lint (or --list-rules)")
    try:
        report = lint_report(scripts, _rule_list(select), _rule_list(ignore_rules), all_files)
    except LintError as exc:
        fail(str(exc))
    if as_json or fmt == "json":
        click.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        click.echo(format_report(report))
    raise click.exceptions.Exit(1 if report.findings else 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(lint())
