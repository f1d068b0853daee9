"""Where a script's values come from, for `disttrain lint`: ranks, env dicts, data loaders.

Real scripts rarely name their rank `rank`: the DDP tutorial keeps it as
`self.gpu_id = int(os.environ["LOCAL_RANK"])`, minGPT as `self.global_rank`, the multi-node
`ddp/example.py` reads it out of a dict of environment variables. `Flow` follows a value
from where it is made to where it is used, through assignments (tuple ones included),
`self.` attributes, arguments of functions, constructors and methods, and return values,
until nothing changes (a fixpoint of at most 8 rounds). The kinds it tracks:

- `local`: LOCAL_RANK, `get_local_rank()`, `current_device()`, `rank % device_count()`;
- `global`: RANK, `dist.get_rank()`, whatever `init_process_group(rank=...)` receives;
- `envdict`: `os.environ` itself, a copy of it, or a dict built from its entries;
- `loader`: a `DataLoader(...)` (DT003 follows it to the loop that iterates it).

Attributes are keyed by name alone (`self.gpu_id` in any class): scripts are small and a
class-precise analysis would miss the tutorial's `Trainer(model, train_data, ...)`. See
docs/troubleshooting.md §3 for the rules that use it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from typing import Protocol

MODULE = "<module>"
ATTR = "<attr>"
RANKS = ("local", "global")
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
Key = tuple[str, str]


class Script(Protocol):
    """What Flow needs of lint_ctx.ScriptInfo (a Protocol: the modules do not import each other)."""

    nodes: list[ast.AST]
    calls: list[ast.Call]

    def qualname(self, expr: ast.AST) -> str | None: ...
    def call_name(self, call: ast.Call) -> str: ...
    def scope_of(self, node: ast.AST) -> str: ...
    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None: ...
    def method_calls(self, *attrs: str) -> Iterator[ast.Call]: ...


def env_key(expr: ast.AST, is_envdict: Callable[[ast.AST], bool] | None = None) -> str | None:
    """'RANK' for os.environ['RANK'], os.environ.get('RANK'), os.getenv('RANK'), env['RANK']."""
    def environ(e: ast.AST) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "environ") or bool(
            is_envdict and is_envdict(e))
    if isinstance(expr, ast.Subscript) and environ(expr.value):
        key = expr.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    if isinstance(expr, ast.Call) and expr.args and isinstance(expr.args[0], ast.Constant):
        func = expr.func
        is_get = isinstance(func, ast.Attribute) and func.attr == "get" and environ(func.value)
        is_getenv = isinstance(func, ast.Attribute) and func.attr == "getenv"
        if (is_get or is_getenv) and isinstance(expr.args[0].value, str):
            return expr.args[0].value
    return None


class Flow:
    """The kinds of value (local/global rank, env dict, loader) each name and attribute holds.

    `info` is the script's ScriptInfo, seen through the `Script` protocol.
    """

    def __init__(self, info: Script) -> None:
        self.info = info
        self.kinds: dict[Key, set[str]] = {}
        self.returns: dict[str, set[str]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        for node in info.nodes:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
                for item in node.body:
                    if isinstance(item, _FUNCS):
                        self.methods.setdefault(item.name, []).append(item)
        method_ids = {id(m) for ms in self.methods.values() for m in ms}
        for node in info.nodes:
            if isinstance(node, _FUNCS) and id(node) not in method_ids:
                self.functions.setdefault(node.name, node)
        self._run()

    # -- questions -------------------------------------------------------------------------
    def of(self, expr: ast.AST, scope: str) -> set[str]:
        """The kinds `expr` may hold in function `scope`."""
        info = self.info
        key = env_key(expr, lambda e: "envdict" in self.of(e, scope))
        if key is not None and isinstance(expr, (ast.Subscript, ast.Call)):
            return {"local"} if key == "LOCAL_RANK" else {"global"} if key == "RANK" else set()
        if isinstance(expr, ast.Call):
            name = info.call_name(expr)
            short = name.split(".")[-1]
            if short in ("get_local_rank", "get_node_local_rank", "current_device",
                         "current_device_index"):
                return {"local"}
            if short == "get_rank" or name.endswith("get_global_rank"):
                return {"global"}
            if name in ("int", "str") and expr.args:
                return self.of(expr.args[0], scope)
            if short.endswith("DataLoader"):
                return {"loader"}
            if name in ("dict", "copy.copy", "copy.deepcopy") and expr.args:
                return self.of(expr.args[0], scope) & {"envdict"}
            if isinstance(expr.func, ast.Attribute) and expr.func.attr == "copy":
                return self.of(expr.func.value, scope) & {"envdict"}
            if isinstance(expr.func, ast.Name):
                return set(self.returns.get(expr.func.id, ()))
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in self.methods:
                return set(self.returns.get(expr.func.attr, ()))
            return set()
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod):
            return {"local"}   # rank % torch.cuda.device_count(): a valid device index
        if isinstance(expr, ast.IfExp):
            return self.of(expr.body, scope) | self.of(expr.orelse, scope)
        if isinstance(expr, ast.DictComp) and env_key(expr.value) is None and \
                isinstance(expr.value, ast.Subscript) and isinstance(expr.value.value,
                                                                     ast.Attribute) \
                and expr.value.value.attr == "environ":
            return {"envdict"}   # {k: os.environ[k] for k in (...)}
        if isinstance(expr, ast.Attribute):
            if expr.attr == "environ" and (info.qualname(expr) or "").endswith(
                    "os.environ"):
                return {"envdict"}
            found = set(self.kinds.get((ATTR, expr.attr), ()))
            if expr.attr in ("local_rank", "gpu") and "global" not in found:
                found.add("local")
            return found
        if isinstance(expr, ast.Name):
            found = set(self.kinds.get((scope, expr.id), ()))
            if expr.id == "local_rank" and "global" not in found:
                found.add("local")
            return found
        return set()

    def rank_kind(self, expr: ast.AST, scope: str) -> str | None:
        """'local', 'global' or None; a value seen as both counts as local (a device index)."""
        kinds = self.of(expr, scope)
        return "local" if "local" in kinds else "global" if "global" in kinds else None

    # -- propagation -----------------------------------------------------------------------
    def _run(self) -> None:
        info = self.info
        relevant = [n for n in info.nodes
                    if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Return, ast.Call))]
        for _ in range(8):
            before = self._size()
            for node in relevant:
                scope = info.scope_of(node)
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        self._assign(target, node.value, scope)
                elif isinstance(node, ast.Return) and node.value is not None:
                    func = info.function_of(node)
                    kinds = self.of(node.value, scope)
                    if func is not None and kinds:
                        self.returns.setdefault(func.name, set()).update(kinds)
                elif isinstance(node, ast.Call):
                    self._call(node, scope)
            if self._size() == before:
                break

    def _size(self) -> int:
        return sum(map(len, self.kinds.values())) + sum(map(len, self.returns.values()))

    def _assign(self, target: ast.AST, value: ast.AST, scope: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts):
                    self._assign(t, v, scope)
            return
        kinds = self.of(value, scope)
        if kinds:
            self._mark(self._key(target, scope), kinds)

    def _key(self, target: ast.AST, scope: str) -> Key | None:
        if isinstance(target, ast.Name):
            return (scope, target.id)
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == "self":
            return (ATTR, target.attr)
        return None

    def _mark(self, key: Key | None, kinds: set[str]) -> None:
        if key is not None:
            self.kinds.setdefault(key, set()).update(kinds)

    def targets(self, call: ast.Call) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef,
                                                         list[str]]]:
        """The functions a call may run, each with its parameters as the call fills them."""
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.functions:
            fn = self.functions[func.id]
            yield fn, [a.arg for a in fn.args.args]
        elif isinstance(func, ast.Name) and func.id in self.classes:
            for item in self.classes[func.id].body:
                if isinstance(item, _FUNCS) and item.name == "__init__":
                    yield item, [a.arg for a in item.args.args][1:]
        elif isinstance(func, ast.Attribute) and func.attr in self.methods:
            for fn in self.methods[func.attr]:
                params = [a.arg for a in fn.args.args]
                yield fn, params[1:] if params and params[0] in ("self", "cls") else params

    def _call(self, call: ast.Call, scope: str) -> None:
        if self.info.call_name(call).endswith("init_process_group"):
            for kw in call.keywords:   # whatever init_process_group takes as rank= is global
                if kw.arg == "rank":
                    self._mark(self._key(kw.value, scope), {"global"})
            return
        for fn, params in self.targets(call):
            pairs = list(zip(params, call.args))
            pairs += [(kw.arg, kw.value) for kw in call.keywords if kw.arg in params]
            for param, arg in pairs:
                kinds = self.of(arg, scope)
                if kinds:
                    self._mark((fn.name, param), kinds)
                # a parameter used as the global rank makes the caller's variable global
                if isinstance(arg, ast.Name) and "global" in self.kinds.get((fn.name, param), ()):
                    self._mark((scope, arg.id), {"global"})


def literal_str(expr: ast.AST | None) -> str | None:
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None


def keyword(call: ast.Call, name: str, position: int | None = None) -> ast.AST | None:
    """The argument `name` of a call, given by keyword or at `position`."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None and len(call.args) > position:
        arg = call.args[position]
        return None if isinstance(arg, ast.Starred) else arg
    return None


def _dest(call: ast.Call) -> str | None:
    """The attribute argparse stores an `add_argument(...)` in."""
    dest = literal_str(keyword(call, "dest"))
    if dest:
        return dest
    flags = [literal_str(a) or "" for a in call.args]
    longs = [f for f in flags if f.startswith("--")] or [f for f in flags if f.startswith("-")]
    name = (longs[0] if longs else flags[0] if flags else "").lstrip("-")
    return name.replace("-", "_") or None


def argparse_default(info: Script, expr: ast.AST) -> ast.AST | None:
    """The literal default of `args.X` when `args` comes from parse_args() (or is passed
    on under that name), argparse declares X once with a constant default, and the script
    never assigns `args.X` itself; else None."""
    if not (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)):
        return None
    parsed = {t.id for n in info.nodes if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
              and n.value.func.attr in ("parse_args", "parse_known_args")
              for t in n.targets if isinstance(t, ast.Name)}
    if expr.value.id not in parsed:
        return None
    if any(isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == expr.attr
           for n in info.nodes):
        return None
    found = [c for c in info.method_calls("add_argument") if _dest(c) == expr.attr]
    default = keyword(found[0], "default") if len(found) == 1 else None
    return default if isinstance(default, ast.Constant) and default.value is not None else None
