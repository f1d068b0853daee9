"""The files a shipped script reads and writes beside itself, read from its source (never run).

    files = script_files(shipped_py_files, root, volumes=[...], mount="/workspace")
    files.execs    # [(path, why)]: `exec(open("configurator.py").read())`: ship and follow
    files.reads    # [(path, why)]: `open("config.yaml")`, `yaml.safe_load(open(...))`: ship
    files.notes    # opened files that are not there or too big, and saves that vanish

A script shipped in the ConfigMap runs in the pod's emptyDir workspace (the code mount,
`workingDir`), with only the files `k8s render` puts there. A single-file trainer that
reads its configuration with `exec(open("configurator.py").read())` or
`open("config.yaml")` dies with FileNotFoundError unless those files travel too, and a
checkpoint it saves into its working directory (`torch.save(ckpt, "ckpt.pt")`,
`os.path.join(out_dir, ...)` with `out_dir = "out"`) is deleted with the pod. Only paths
the source names with string literals are followed (a literal, `os.path.join` of literals,
an f-string's literal start, a name or parameter default bound to one): what comes from
the command line cannot be known here and is not guessed.
"""

from __future__ import annotations

import ast
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from disttrain.pysource import dotted_name, import_aliases, parse_file

MAX_SHIPPED_DATA = 256 * 1024   # bytes: larger read files belong on a volume, not a ConfigMap
_WRITERS = ("torch.save", "numpy.save", "numpy.savez", "numpy.savetxt")
_WRITE_METHODS = ("save_pretrained", "savefig", "to_csv", "to_json", "to_parquet")
_READ_ONLY = ("r", "rb", "rt", "r+", "rb+")


@dataclass
class ScriptFiles:
    """What the shipped Python files open beside themselves."""

    execs: list[tuple[Path, str]] = field(default_factory=list)
    reads: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _literal(expr: ast.AST | None, names: dict[str, str]) -> str | None:
    """The path an expression names with literals, or None when part of it is not literal."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        return names.get(f"{expr.value.id}.{expr.attr}")
    if isinstance(expr, ast.JoinedStr) and expr.values and isinstance(expr.values[0], ast.Constant):
        return f"{expr.values[0].value}*"   # f"out/ckpt_{epoch}.pt": its folder is literal
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and \
            expr.func.attr == "join" and expr.args:
        parts = [_literal(a, names) for a in expr.args]
        if parts[0] is not None:
            return posixpath.join(*[p if p is not None else "*" for p in parts])
    return None


def _bound_literals(tree: ast.Module) -> dict[str, str]:
    """Names bound to one string literal in the whole file: assignments and parameter
    defaults (`out_dir = "out"`, `def main(snapshot_path="snapshot.pt")`)."""
    seen: dict[str, set[str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            value = node.value.value if isinstance(node.value, ast.Constant) and isinstance(
                node.value.value, str) else None
            for t in node.targets:
                if isinstance(t, ast.Name):
                    seen.setdefault(t.id, set()).add(value)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [*node.args.posonlyargs, *node.args.args]
            defaults = node.args.defaults
            for arg, default in zip(params[len(params) - len(defaults):], defaults):
                if isinstance(default, ast.Constant) and isinstance(default.value, str):
                    seen.setdefault(arg.arg, set()).add(default.value)
    out: dict[str, str] = {}
    for name, values in seen.items():
        value = next(iter(values))
        if len(values) == 1 and value:
            out[name] = value
    attrs: dict[str, set[str | None]] = {}   # self.snapshot_path = snapshot_path
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    attrs.setdefault(f"self.{t.attr}", set()).add(_literal(node.value, out))
    for name, values in attrs.items():
        value = next(iter(values))
        if len(values) == 1 and value:
            out[name] = value
    return out


def _mode(call: ast.Call) -> str:
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def _uses(tree: ast.Module) -> Iterable[tuple[str, ast.Call, str | None]]:
    """('exec' | 'read' | 'write', call, the literal path) for every open/save in `tree`."""
    aliases = import_aliases(ast.walk(tree))
    names = _bound_literals(tree)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    execs: dict[int, ast.Call] = {}   # id(open call) -> exec(open(...).read())
    for call in calls:
        inner = call.args[0] if dotted_name(call.func, aliases) == "exec" and call.args else None
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                and isinstance(inner.func.value, ast.Call) and inner.func.value.args \
                and dotted_name(inner.func.value.func, aliases) == "open":
            execs[id(inner.func.value)] = inner.func.value
    for call in calls:
        name = dotted_name(call.func, aliases) or ""
        if name == "open" and call.args:
            path = _literal(call.args[0], names)
            if id(call) in execs:
                yield "exec", call, path
            elif _mode(call) not in _READ_ONLY and any(c in _mode(call) for c in "wax+"):
                yield "write", call, path
            else:
                yield "read", call, path
        elif name in _WRITERS or name.endswith(("np.save", "np.savez")):
            target = call.args[1] if name == "torch.save" and len(call.args) > 1 else (
                call.args[0] if name != "torch.save" and call.args else next(
                    (k.value for k in call.keywords if k.arg == "f"), None))
            yield "write", call, _literal(target, names)
        elif isinstance(call.func, ast.Attribute) and call.func.attr in _WRITE_METHODS \
                and call.args:
            yield "write", call, _literal(call.args[0], names)


def script_files(py_files: list[tuple[Path, str]], root: Path, mount: str,
                 volume_mounts: Iterable[str] = ()) -> ScriptFiles:
    """What `py_files` (shipped, each with its path under the mount) open and write.

    Args:
        py_files: (local file, its path relative to `root`).
        root: the script's folder, the pod's working directory.
        mount: that directory in the pod (the code mount, an emptyDir).
        volume_mounts: where volumes are mounted: writes there outlive the pod.
    """
    out = ScriptFiles()
    seen: set[Path] = {p.resolve() for p, _ in py_files}
    lost: list[str] = []
    opened: list[tuple[str, str, str]] = []   # (use, literal, where)
    written: set[str] = set()
    for path, rel in py_files:
        try:
            tree = parse_file(path)
        except (OSError, SyntaxError, ValueError):
            continue
        for use, call, literal in _uses(tree):
            where = f"{rel}:{call.lineno}"
            if literal is None or posixpath.isabs(literal):
                continue   # from the command line, or an absolute path (a volume's, maybe)
            if use != "write":
                opened.append((use, literal, where))
                continue
            written.add(posixpath.normpath(literal))
            in_pod = posixpath.normpath(posixpath.join(mount, literal.replace("*", "x")))
            if not any(posixpath.commonpath([in_pod, v]) == posixpath.normpath(v)
                       for v in volume_mounts):
                folder = posixpath.dirname(literal)
                shown = f"{folder}/" if "*" in literal and folder else literal
                lost.append(f"{shown} ({where})")
    for use, literal, where in opened:
        if posixpath.normpath(literal) not in written:   # read back what it wrote: its own
            _opened(out, use, root, literal, where, seen)
    if lost:
        out.notes.append(
            f"script: writes {', '.join(dict.fromkeys(lost))} into its working directory "
            f"{mount}, the pod's emptyDir: the files vanish with the pod; write them to a "
            f"volume instead (--volumes '[{{name: out, pvc: NAME, mount: /out}}]' and a path "
            f"under /out)")
    return out


def _opened(out: ScriptFiles, use: str, root: Path, literal: str, where: str,
            seen: set[Path]) -> None:
    """Ship a read file found beside the script, or say why it cannot be."""
    local = (root / literal).resolve()   # the pod's working directory is the script's folder
    try:
        local.relative_to(root.resolve())
    except ValueError:
        out.notes.append(f"script: {where} opens {literal}, outside the script's folder: it "
                         f"is not shipped; the pod fails with FileNotFoundError unless the "
                         f"image or a volume has it")
        return
    if local in seen or local.is_dir():
        return
    if not local.is_file():
        out.notes.append(f"script: {where} opens {literal}, which is not in {root}: nothing "
                         f"is shipped for it; the pod fails with FileNotFoundError unless "
                         f"the script creates it first")
        return
    seen.add(local)
    if use == "read" and local.stat().st_size > MAX_SHIPPED_DATA:
        out.notes.append(f"script: {where} reads {literal} ({local.stat().st_size / 2**20:.1f} "
                         f"MiB): too big to ship in the ConfigMap; put it on a volume "
                         f"(--volumes) or in the image")
        return
    why = f"{'exec' if use == 'exec' else 'opened'} by {where}"
    (out.execs if use == "exec" and local.suffix == ".py" else out.reads).append((local, why))
