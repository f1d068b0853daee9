"""The local modules a linted script imports, read (never run) for what they do to it.

Some facts about a script live in a helper beside it: the vision codebases' distributed
setup (`utils.init_distributed_mode(args)`) calls `setup_for_distributed(rank == 0)`,
which replaces `builtins.print` by one that prints only on rank 0 (torchvision's
references/classification/utils.py, DETR, MAE and their descendants). A print in such a
script runs on every rank but writes once, so DT004 must know about the override even
when it sits in another file.

`local_modules(path, tree)` follows the script's imports to files in its folder (and,
for relative imports, its package): `import utils`, `import util.misc as misc`,
`from utils import init_distributed_mode`, `from .helpers import setup`, transitively, at
most `MAX_MODULES` files; a file that cannot be read or parsed is left out (Python would
decide at run time; the lint does not guess).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from disttrain.pysource import dotted_name, import_aliases, imports_in, parse_file

MAX_MODULES = 30
_BUILTINS = ("builtins", "__builtin__", "__builtins__")


def local_modules(path: str | None, tree: ast.Module) -> list[ast.Module]:
    """The syntax trees of the local modules the script at `path` imports, transitively
    (the script itself not included); [] for a script given as a string."""
    if not path:
        return []
    script = Path(path)
    if not script.is_file():
        return []
    folder = script.resolve().parent
    seen: set[Path] = {script.resolve()}
    out: list[ast.Module] = []
    queue = _imported_files(tree, folder, folder)
    while queue and len(out) < MAX_MODULES:
        file = queue.pop(0)
        if file in seen:
            continue
        seen.add(file)
        parsed = _parse(file)
        if parsed is None:
            continue
        out.append(parsed)
        queue += _imported_files(parsed, folder, file.parent)
    return out


def _parse(file: Path) -> ast.Module | None:
    try:
        st = file.stat()
    except OSError:
        return None
    return _parse_version(file, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=128)
def _parse_version(file: Path, mtime_ns: int, size: int) -> ast.Module | None:
    """One parse per version of a file: `lint DIR` meets the same helper once per script."""
    try:
        return parse_file(file)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _imported_files(tree: ast.Module, root: Path, here: Path) -> list[Path]:
    """Files under `root` that `tree`'s imports name (`here`: the importing file's folder,
    for relative imports)."""
    found: list[Path] = []
    for node in imports_in(ast.walk(tree)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found += _module_files(root, alias.name.split("."))
        elif node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
            found += _module_files(base, parts, [a.name for a in node.names])
        elif node.module:
            found += _module_files(root, node.module.split("."), [a.name for a in node.names])
    return found


def _module_files(base: Path, parts: list[str], names: list[str] | tuple[str, ...] = ()
                  ) -> list[Path]:
    """`base/a/b.py` or `base/a/b/__init__.py` for `a.b`, the packages on the way, and
    `from a import c` where c is a submodule."""
    out: list[Path] = []
    folder = base
    for i, part in enumerate(parts):
        if i == len(parts) - 1:
            out += [p for p in (folder / f"{part}.py", folder / part / "__init__.py")
                    if p.is_file()]
        elif (folder / part / "__init__.py").is_file():
            out.append(folder / part / "__init__.py")
        folder = folder / part
    if folder.is_dir():
        out += [folder / f"{n}.py" for n in names if (folder / f"{n}.py").is_file()]
    return [p.resolve() for p in out]


def overrides_print(tree: ast.Module) -> bool:
    """`builtins.print = ...` (also as `__builtin__`, `setattr(builtins, "print", f)` or
    `__builtins__["print"] = ...`) somewhere in `tree`: the setup_for_distributed idiom."""
    aliases = import_aliases(ast.walk(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "print" and \
                        (dotted_name(target.value, aliases) or "") in _BUILTINS:
                    return True
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and target.value.id == "__builtins__" and isinstance(
                            target.slice, ast.Constant) and target.slice.value == "print":
                    return True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and len(node.args) == 3 \
                and (dotted_name(node.args[0], aliases) or "") in _BUILTINS \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "print":
            return True
    return False
