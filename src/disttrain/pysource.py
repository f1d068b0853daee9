"""A user's Python file read as a syntax tree, never run: the helpers lint, the own-workers
check and the code shipper share.

    tree = parse_file("train.py")                   # SyntaxError / OSError / ValueError
    aliases = import_aliases(ast.walk(tree))        # {"mp": "torch.multiprocessing", ...}
    dotted_name(call.func, aliases)                 # "torch.multiprocessing.spawn"
    top_level_imports(tree)                         # {"torch", "datautils"}
    optional_imports(tree)                          # {"wandb"}: only under `except ImportError`

Three places read a user's imports: `disttrain lint` (`diagnose/lint_ctx.py`: which call
is `dist.init_process_group`), `disttrain run`'s check of a script that starts its own
workers (`launch/own_workers.py`: is this `mp.spawn`?) and the code shipped to a pod
(`k8s/code.py`: which local modules does the script import?). They read them here, the
same way, so an alias one of them resolves the others resolve too. A module of the top
level because those three live in layers that must not import each other (launch/ never
imports diagnose/). stdlib only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["dotted_name", "import_aliases", "imports_in", "optional_imports", "parse_file",
           "top_level_imports"]

# An `except` of these catches a failed import: what it guards is optional by design.
_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


def parse_file(path: str | Path) -> ast.Module:
    """The syntax tree of the Python file `path`, decoded as Python decodes it (a BOM or a
    `# -*- coding: ... -*-` line).

    Raises:
        OSError: the file cannot be read.
        SyntaxError: it is not valid Python (`lineno`, `msg` say where and why).
        ValueError: it holds a NUL byte (or is otherwise not source).
    """
    return ast.parse(Path(path).read_bytes(), filename=str(path))


def imports_in(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements among `nodes` (e.g. `ast.walk(tree)`)."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_aliases(nodes: Iterable[ast.AST]) -> dict[str, str]:
    """Local name -> the dotted path it stands for, from the absolute imports among `nodes`
    (`import torch.multiprocessing as mp` -> mp: torch.multiprocessing; `import os.path` -> os)."""
    aliases: dict[str, str] = {}
    for node in imports_in(nodes):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
        elif node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def dotted_name(expr: ast.AST, aliases: dict[str, str]) -> str | None:
    """`mp.spawn` -> `torch.multiprocessing.spawn` through `aliases`; None when `expr` is
    not a Name/Attribute chain."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(aliases.get(expr.id, expr.id))
    return ".".join(reversed(parts))


def top_level_imports(nodes: ast.AST | Iterable[ast.AST]) -> set[str]:
    """The top-level names imported absolutely under `nodes` (a tree, or nodes already
    walked): `import a.b` and `from a.b import c` give `a`; relative imports stay inside
    their package and give nothing."""
    walked = ast.walk(nodes) if isinstance(nodes, ast.AST) else nodes
    names: set[str] = set()
    for node in imports_in(walked):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def optional_imports(tree: ast.AST) -> set[str]:
    """The top-level names `tree` imports only inside a `try` whose handler catches
    ImportError (or any exception): optional by design (`try: import wandb`), never a
    reason to fail when they are missing. A name also imported outside such a guard is
    not optional."""
    guarded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for stmt in node.body:
                guarded |= top_level_imports(stmt)
    return guarded - top_level_imports(_unguarded_imports(tree))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(k is None or (isinstance(k, ast.Name) and k.id in _IMPORT_ERRORS) for k in kinds)


def _unguarded_imports(tree: ast.AST) -> list[ast.stmt]:
    """The import statements not inside a guarding `try` body."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found
