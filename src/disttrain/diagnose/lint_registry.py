"""The lint rule registry: a rule's stable id, name, summary and default fix, and its check.

Each check takes a ScriptInfo and yields (node, message, fix or None); None means the
rule's default fix from RULES. Ids are stable: a new rule takes the next free id, a
retired rule's id is never reused. The rules live by topic in `rules_checklist.py`
(DT001-DT005), `rules_sync.py` (DT006-DT010), `rules_pitfalls.py` (DT011-DT018) and
`rules_scripts.py` (DT019 on); `lint.py` imports all four, and RULES lists them in id order.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from disttrain.diagnose.lint_ctx import ScriptInfo

Hit = tuple[ast.AST, str, "str | None"]
Check = Callable[[ScriptInfo], Iterator[Hit]]


@dataclass(frozen=True)
class Rule:
    """A rule's stable id, short name, what it catches, and the default fix."""

    id: str
    name: str
    summary: str
    fix: str


RULES: dict[str, Rule] = {}
CHECKS: dict[str, Check] = {}


def rule(rule_id: str, name: str, summary: str, fix: str) -> Callable[[Check], Check]:
    """Register a check under its stable id."""
    def register(fn: Check) -> Check:
        RULES[rule_id] = Rule(rule_id, name, summary, fix)
        CHECKS[rule_id] = fn
        for table in (RULES, CHECKS):   # keep id order whatever the import order of the topics
            ordered = sorted(table.items())
            table.clear()
            table.update(ordered)
        return fn
    return register


def src(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
