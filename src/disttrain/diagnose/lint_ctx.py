"""What `disttrain lint` knows about a script: imports, rank-0 guards, where ranks come from.

Rules ask questions that need more than one node of the AST: "is this torch.save only
run on rank 0?", "is this device index the local or the global rank?". This module
answers them once per script, without running it and without importing torch:

- `qualname(expr)` resolves aliases: with `import torch.distributed as dist`,
  `dist.init_process_group` is `torch.distributed.init_process_group`;
- `guarded(node)` is True when the node only runs on rank 0: inside `if rank == 0:`
  (or `is_main_process`, `not rank`, ...), after `if rank != 0: return`, or in a function
  every call of which is so guarded;
- `rank_kind(expr, scope)` says whether a value is the *local* rank (LOCAL_RANK, or a
  function returning it) or the *global* rank (RANK, dist.get_rank(), whatever is passed
  as `rank=` to init_process_group), following assignments, arguments and returns.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

MODULE = "<module>"
_RANKISH = re.compile(r"rank", re.IGNORECASE)
_MAIN_FLAGS = re.compile(
    r"^(?:is_)?(?:main|master|chief|rank_?0|rank_?zero|global_zero|main_process|"
    r"master_process|local_master|local_main|is_main_process|is_local_main_process|"
    r"is_world_process_zero|is_local_process_zero)$", re.IGNORECASE)
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


class ScriptInfo:
    """Facts about one parsed script, shared by all lint rules."""

    def __init__(self, tree: ast.Module, source: str) -> None:
        self.tree = tree
        self.source = source
        self.nodes: list[ast.AST] = list(ast.walk(tree))   # walk once; rules reuse it
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases = self._imports()
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.calls: list[ast.Call] = []
        self.assignments: dict[str, list[ast.AST]] = {}   # name -> Assign/AugAssign/AnnAssign
        self._referenced: set[str] = set()
        for node in self.nodes:
            if isinstance(node, _FUNCS):
                self.functions.setdefault(node.name, node)
            elif isinstance(node, ast.Call):
                self.calls.append(node)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                self._referenced.add(node.id)
            elif isinstance(node, ast.Attribute):
                self._referenced.add(node.attr)
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Name):
                    self.assignments.setdefault(t.id, []).append(node)
        self._call_names = {id(c): self.qualname(c.func) for c in self.calls}
        self._guard_cache: dict[str, bool] = {}
        self.local: set[tuple[str, str]] = set()
        self.global_: set[tuple[str, str]] = set()
        self._returns: dict[str, str] = {}
        self._taint()

    # -- names ---------------------------------------------------------------------------
    def _imports(self) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return aliases

    def qualname(self, expr: ast.AST) -> str | None:
        """Dotted name of a Name/Attribute chain with import aliases resolved."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        parts.append(self.aliases.get(expr.id, expr.id))
        return ".".join(reversed(parts))

    def call_name(self, call: ast.Call) -> str:
        """Qualified name of the called function, '' when not a plain name chain."""
        name = self._call_names.get(id(call))
        if name is None and id(call) not in self._call_names:
            name = self.qualname(call.func)
        return name or ""

    def calls_to(self, *suffixes: str) -> Iterator[ast.Call]:
        """Calls whose qualified name is one of `suffixes` or ends with `.suffix`."""
        for call in self.calls:
            name = self.call_name(call)
            if any(name == s or name.endswith("." + s) for s in suffixes):
                yield call

    def method_calls(self, *attrs: str) -> Iterator[ast.Call]:
        for call in self.calls:
            if isinstance(call.func, ast.Attribute) and call.func.attr in attrs:
                yield call

    # -- structure -------------------------------------------------------------------------
    def scope_of(self, node: ast.AST) -> str:
        """Name of the enclosing function, or MODULE."""
        cur = self.parents.get(node)
        while cur is not None:
            if isinstance(cur, _FUNCS):
                return cur.name
            cur = self.parents.get(cur)
        return MODULE

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, _FUNCS):
            cur = self.parents.get(cur)
        return cur

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def is_docstring(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        if not isinstance(parent, ast.Expr):
            return False
        owner = self.parents.get(parent)
        body = getattr(owner, "body", None)
        return bool(body) and body[0] is parent and isinstance(
            owner, (ast.Module, ast.ClassDef, *_FUNCS))

    def in_unused_function(self, node: ast.AST) -> bool:
        """Inside a function this module never calls nor passes on (a library API):
        where and on how many ranks it runs cannot be told from here."""
        for anc in self.ancestors(node):
            if isinstance(anc, _FUNCS) and anc.name not in self._referenced:
                return True
        return False

    def in_except(self, node: ast.AST) -> bool:
        return any(isinstance(a, ast.ExceptHandler) for a in self.ancestors(node))

    # -- rank-0 guards -------------------------------------------------------------------
    def is_rank_expr(self, expr: ast.AST) -> bool:
        """Does this expression denote a rank (a name containing 'rank', get_rank(), ...)?"""
        if isinstance(expr, ast.Call):
            name = self.call_name(expr)
            if name.endswith(("get_rank", "get_local_rank", "get_node_local_rank",
                              "current_device")):
                return True
            if name == "int" and expr.args:
                return self.is_rank_expr(expr.args[0])
            return _env_key(expr) in ("RANK", "LOCAL_RANK")
        if isinstance(expr, ast.Subscript):
            return _env_key(expr) in ("RANK", "LOCAL_RANK")
        if isinstance(expr, ast.Name):
            return bool(_RANKISH.search(expr.id))
        if isinstance(expr, ast.Attribute):
            return bool(_RANKISH.search(expr.attr))
        return False

    def _is_main_flag(self, expr: ast.AST) -> bool:
        if isinstance(expr, ast.Call):
            expr = expr.func
        if isinstance(expr, ast.Name):
            return bool(_MAIN_FLAGS.match(expr.id))
        if isinstance(expr, ast.Attribute):
            return bool(_MAIN_FLAGS.match(expr.attr))
        return False

    def rank_zero_test(self, test: ast.AST, negated: bool = False) -> bool:
        """True when `test` holds only on rank 0 (negated: only on ranks other than 0)."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.rank_zero_test(test.operand, not negated)
        if isinstance(test, ast.BoolOp):
            parts = [self.rank_zero_test(v, negated) for v in test.values]
            # `a and b` restricts to rank 0 if either does; `a or b` widens unless both do
            return any(parts) if isinstance(test.op, ast.And) != negated else all(parts)
        if self._is_main_flag(test):
            return not negated
        if self.is_rank_expr(test):   # `if rank:` holds on ranks other than 0
            return negated
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, op, right = test.left, test.ops[0], test.comparators[0]
            if isinstance(op, (ast.In, ast.NotIn)) and self.is_rank_expr(left) \
                    and isinstance(right, (ast.List, ast.Tuple, ast.Set)) \
                    and any(_is_zero(e) for e in right.elts) \
                    and all((_int(e) or 0) <= 0 and _int(e) is not None for e in right.elts):
                # `local_rank in (-1, 0)`: rank 0, or not distributed at all
                return isinstance(op, ast.In) != negated
            if _is_zero(left):
                left, right = right, left
                op = {ast.Gt: ast.Lt(), ast.Lt: ast.Gt()}.get(type(op), op)
            if not (_is_zero(right) and self.is_rank_expr(left)):
                return False
            if isinstance(op, (ast.Eq, ast.Is, ast.LtE)):
                return not negated
            if isinstance(op, (ast.NotEq, ast.IsNot, ast.Gt)):
                return negated
        return False

    def guarded(self, node: ast.AST) -> bool:
        """Does `node` run on rank 0 only?"""
        child: ast.AST = node
        for anc in self.ancestors(node):
            if isinstance(anc, (ast.If, ast.IfExp)):
                in_body = child in (anc.body if isinstance(anc.body, list) else [anc.body])
                in_else = child in (anc.orelse if isinstance(anc.orelse, list) else [anc.orelse])
                if in_body and self.rank_zero_test(anc.test):
                    return True
                if in_else and self.rank_zero_test(anc.test, negated=True):
                    return True
            if isinstance(child, ast.stmt) and self._after_early_exit(anc, child):
                return True
            if isinstance(anc, _FUNCS):
                return self._function_guarded(anc.name)
            child = anc
        return False

    def _after_early_exit(self, parent: ast.AST, stmt: ast.stmt) -> bool:
        """`if rank != 0: return` earlier in the same block."""
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and stmt in block:
                for prev in block[:block.index(stmt)]:
                    if (isinstance(prev, ast.If) and not prev.orelse and prev.body
                            and isinstance(prev.body[-1], _EXITS)
                            and self.rank_zero_test(prev.test, negated=True)):
                        return True
        return False

    def _function_guarded(self, name: str) -> bool:
        """Every call of this function (or method) in the module runs on rank 0 only."""
        if name in self._guard_cache:
            return self._guard_cache[name]
        self._guard_cache[name] = False   # recursion: assume not guarded
        sites = [c for c in self.calls   # f(...) and, for methods, self.f(...)
                 if (isinstance(c.func, ast.Name) and c.func.id == name)
                 or (isinstance(c.func, ast.Attribute) and c.func.attr == name)]
        result = bool(sites) and all(self.guarded(c) for c in sites)
        self._guard_cache[name] = result
        return result

    # -- local vs global rank ------------------------------------------------------------
    def rank_kind(self, expr: ast.AST, scope: str) -> str | None:
        """'local' (LOCAL_RANK-derived), 'global' (RANK-derived) or None (unknown)."""
        if isinstance(expr, (ast.Subscript, ast.Call)) and _env_key(expr):
            return {"LOCAL_RANK": "local", "RANK": "global"}.get(_env_key(expr) or "")
        if isinstance(expr, ast.Call):
            name = self.call_name(expr)
            if name.endswith(("get_local_rank", "get_node_local_rank", "current_device")):
                return "local"
            if name.endswith("get_rank"):
                return "global"
            if name in ("int", "str") and expr.args:
                return self.rank_kind(expr.args[0], scope)
            if isinstance(expr.func, ast.Name) and expr.func.id in self._returns:
                return self._returns[expr.func.id]
            return None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod):
            return "local"   # rank % torch.cuda.device_count(): a valid device index
        if isinstance(expr, ast.Attribute) and expr.attr in ("local_rank", "gpu"):
            return "local"
        if isinstance(expr, ast.Name):
            key = (scope, expr.id)
            if key in self.local or (expr.id == "local_rank" and key not in self.global_):
                return "local"
            if key in self.global_:
                return "global"
        return None

    def _taint(self) -> None:
        """Propagate local/global rank through assignments, arguments, returns (fixpoint)."""
        relevant = [n for n in self.nodes if isinstance(n, (ast.Assign, ast.Return, ast.Call))]
        for _ in range(8):
            before = (len(self.local), len(self.global_), len(self._returns))
            for node in relevant:
                if isinstance(node, ast.Assign):
                    kind = self.rank_kind(node.value, self.scope_of(node))
                    for target in node.targets:
                        if isinstance(target, ast.Name) and kind:
                            self._mark(self.scope_of(node), target.id, kind)
                elif isinstance(node, ast.Return) and node.value is not None:
                    func = self.function_of(node)
                    kind = self.rank_kind(node.value, self.scope_of(node))
                    if func is not None and kind:
                        self._returns.setdefault(func.name, kind)
                elif isinstance(node, ast.Call):
                    self._taint_call(node)
            if (len(self.local), len(self.global_), len(self._returns)) == before:
                break

    def _taint_call(self, call: ast.Call) -> None:
        scope = self.scope_of(call)
        if self.call_name(call).endswith("init_process_group"):
            for kw in call.keywords:   # whatever init_process_group takes as rank= is global
                if kw.arg == "rank" and isinstance(kw.value, ast.Name):
                    self._mark(scope, kw.value.id, "global")
            return
        if not isinstance(call.func, ast.Name) or call.func.id not in self.functions:
            return
        func = self.functions[call.func.id]
        params = [a.arg for a in func.args.args]
        pairs = list(zip(params, call.args))
        pairs += [(kw.arg, kw.value) for kw in call.keywords if kw.arg in params]
        for param, arg in pairs:
            kind = self.rank_kind(arg, scope)
            if kind:
                self._mark(func.name, param, kind)
            # a parameter used as the global rank makes the caller's variable global
            if isinstance(arg, ast.Name) and (func.name, param) in self.global_:
                self._mark(scope, arg.id, "global")

    def _mark(self, scope: str, name: str, kind: str) -> None:
        (self.local if kind == "local" else self.global_).add((scope, name))

    # -- script-level facts ----------------------------------------------------------------
    def is_distributed(self) -> bool:
        """Does the script run as several processes (init_process_group, DDP, spawn, ...)?"""
        return any(True for _ in self.calls_to(
            "init_process_group", "DistributedDataParallel", "DistributedSampler",
            "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"))

    def uses_gpu(self) -> bool:
        """Does the script put tensors on a GPU (weak signals count: 'cuda' strings too)?"""
        if self.trains_on_gpu():
            return True
        for node in self.nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("cuda"):
                return True
            if isinstance(node, ast.Attribute):
                name = self.qualname(node) or ""
                if name.startswith("torch.cuda.") and not name.endswith(
                        ("is_available", "device_count")):
                    return True
        return False

    def trains_on_gpu(self) -> bool:
        """Strong signals only: .cuda(), set_device, DDP device_ids, .to(<rank>)."""
        for call in self.calls:
            name = self.call_name(call)
            if name.endswith("cuda.set_device") or any(k.arg == "device_ids"
                                                       for k in call.keywords):
                return True
            if isinstance(call.func, ast.Attribute) and call.func.attr == "cuda":
                return True
            if (isinstance(call.func, ast.Attribute) and call.func.attr == "to" and call.args
                    and self.is_rank_expr(call.args[0])):
                return True
        return False


def _is_zero(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Constant) and expr.value == 0 and not isinstance(expr.value,
                                                                                bool)


def _int(expr: ast.AST) -> int | None:
    """The value of an int literal, negative ones (`-1`) included."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _int(expr.operand)
        return -inner if inner is not None else None
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    return None


def _env_key(expr: ast.AST) -> str | None:
    """'RANK' for os.environ['RANK'], os.environ.get('RANK'), os.getenv('RANK')."""
    if isinstance(expr, ast.Subscript) and _is_environ(expr.value):
        key = expr.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
    if isinstance(expr, ast.Call) and expr.args and isinstance(expr.args[0], ast.Constant):
        func = expr.func
        is_get = isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)
        is_getenv = isinstance(func, ast.Attribute) and func.attr == "getenv"
        if (is_get or is_getenv) and isinstance(expr.args[0].value, str):
            return expr.args[0].value
    return None


def _is_environ(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == "environ"


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
