"""What `disttrain lint` knows about a script: imports, rank-0 guards, where ranks come from.

Rules ask questions that need more than one node of the AST: "is this torch.save only
run on rank 0?", "is this device index the local or the global rank?". This module
answers them once per script, without running it and without importing torch:

- `qualname(expr)` resolves aliases: with `import torch.distributed as dist`,
  `dist.init_process_group` is `torch.distributed.init_process_group`;
- `guarded(node)` is True when the node only runs on rank 0: inside `if rank == 0:`
  (or `is_main_process`, `not rank`, ...), after `if rank != 0: return`, or in a function
  every call of which is so guarded (`guard_of` also says which rank the guard tests);
- `rank_kind(expr, scope)` says whether a value is the *local* rank (LOCAL_RANK, or a
  function returning it) or the *global* rank (RANK, dist.get_rank(), whatever is passed
  as `rank=` to init_process_group); `lint_flow.Flow` follows it through assignments,
  `self.` attributes, arguments of functions, constructors and methods, and returns;
- `before_process_group(node)`, `spawn_parent(node)`, `single_node()`: when and on how
  many processes a line runs.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from disttrain.diagnose.lint_flow import (  # noqa: F401  (literal_str, keyword, argparse_default: the rules' helpers)
    Flow,
    argparse_default,
    env_key,
    keyword,
    literal_str,
)
from disttrain.pysource import dotted_name, import_aliases

MODULE = "<module>"
_RANKISH = re.compile(r"rank", re.IGNORECASE)
_MAIN_FLAGS = re.compile(
    r"^(?:is_)?(?:main|master|chief|rank_?0|rank_?zero|global_zero|main_process|"
    r"master_process|local_master|local_main|is_main_process|is_local_main_process|"
    r"is_world_process_zero|is_local_process_zero)$", re.IGNORECASE)
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_INITS = ("init_process_group", "init_device_mesh")   # what creates the process group


class ScriptInfo:
    """Facts about one parsed script, shared by all lint rules."""

    def __init__(self, tree: ast.Module, source: str, path: str | None = None) -> None:
        self.tree = tree
        self.source = source
        self.path = path   # the script's file, for the local modules it imports (None: a string)
        self.nodes: list[ast.AST] = list(ast.walk(tree))   # walk once; rules reuse it
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases = import_aliases(self.nodes)
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
        self._guard_cache: dict[int, set[str]] = {}
        self.flow = Flow(self)
        self._before_cache: dict[int, bool] = {}
        self._reach_cache: dict[tuple[int, tuple[str, ...]], bool] = {}

    # -- names ---------------------------------------------------------------------------
    def qualname(self, expr: ast.AST) -> str | None:
        """Dotted name of a Name/Attribute chain with import aliases resolved."""
        return dotted_name(expr, self.aliases)

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
        where and on how many ranks it runs cannot be told from here. Methods count as
        used: a constructor runs when its class is called, other methods through objects
        the module may never name (docs/troubleshooting.md §3)."""
        for anc in self.ancestors(node):
            if isinstance(anc, _FUNCS) and anc.name not in self._referenced \
                    and not isinstance(self.parents.get(anc), ast.ClassDef):
                return True
        return False

    def in_except(self, node: ast.AST) -> bool:
        return any(isinstance(a, ast.ExceptHandler) for a in self.ancestors(node))

    # -- rank-0 guards -------------------------------------------------------------------
    def is_rank_expr(self, expr: ast.AST) -> bool:
        """Does this expression denote a rank (get_rank(), a value derived from LOCAL_RANK or
        RANK, a name containing 'rank', ...)?"""
        if isinstance(expr, ast.Call):
            name = self.call_name(expr)
            if name.endswith(("get_rank", "get_local_rank", "get_node_local_rank",
                              "current_device")):
                return True
            if name == "int" and expr.args:
                return self.is_rank_expr(expr.args[0])
        if isinstance(expr, (ast.Call, ast.Subscript)) and env_key(expr) in ("RANK", "LOCAL_RANK"):
            return True
        if isinstance(expr, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) and \
                self.kinds(expr) & {"local", "global"}:
            return True
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
        return bool(self.guard_of(node))

    def _early_exit(self, parent: ast.AST, stmt: ast.stmt) -> ast.If | None:
        """`if rank != 0: return` earlier in the same block."""
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and stmt in block:
                for prev in block[:block.index(stmt)]:
                    if (isinstance(prev, ast.If) and not prev.orelse and prev.body
                            and isinstance(prev.body[-1], _EXITS)
                            and self.rank_zero_test(prev.test, negated=True)):
                        return prev
        return None

    def _function_guarded(self, func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Every call of this function (or method) in the module runs on rank 0 only."""
        return bool(self.guard_kinds(func))

    def guard_kinds(self, func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
        """If every call of `func` is rank-0 guarded: the kinds of rank the guards test
        ('local', 'global', or '?' when unknown); empty when some call is unguarded."""
        key = id(func)
        if key in self._guard_cache:
            return self._guard_cache[key]
        self._guard_cache[key] = set()   # recursion: assume not guarded
        sites = self.call_sites(func)
        kinds: set[str] = set()
        for c in sites:
            found = self.guard_of(c)
            if not found:
                kinds = set()
                break
            kinds |= found
        self._guard_cache[key] = kinds
        return kinds

    def call_sites(self, func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Call]:
        """f(...) and, for methods, self.f(...); a constructor's: calls of its class."""
        name = func.name
        owner = self.parents.get(func)
        if name == "__init__" and isinstance(owner, ast.ClassDef):
            return [c for c in self.calls if isinstance(c.func, ast.Name)
                    and c.func.id == owner.name]
        return [c for c in self.calls
                if (isinstance(c.func, ast.Name) and c.func.id == name)
                or (isinstance(c.func, ast.Attribute) and c.func.attr == name)]

    def guard_of(self, node: ast.AST) -> set[str]:
        """The kinds of rank the rank-0 guard of `node` tests (empty: not guarded)."""
        child: ast.AST = node
        for anc in self.ancestors(node):
            if isinstance(anc, (ast.If, ast.IfExp)):
                in_body = child in (anc.body if isinstance(anc.body, list) else [anc.body])
                in_else = child in (anc.orelse if isinstance(anc.orelse, list) else [anc.orelse])
                if (in_body and self.rank_zero_test(anc.test)) or (
                        in_else and self.rank_zero_test(anc.test, negated=True)):
                    return self._test_kinds(anc.test)
            if isinstance(child, ast.stmt):
                prev = self._early_exit(anc, child)
                if prev is not None:
                    return self._test_kinds(prev.test)
            if isinstance(anc, _FUNCS):
                return self.guard_kinds(anc)
            child = anc
        return set()

    def _test_kinds(self, test: ast.AST) -> set[str]:
        kinds = {k for n in ast.walk(test) for k in self.kinds(n) if k in ("local", "global")}
        for n in ast.walk(test):
            name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(
                n, ast.Name) else ""
            if name and _MAIN_FLAGS.match(name):
                kinds.add("local" if "local" in name.lower() else "?")
        return kinds or {"?"}

    # -- local vs global rank ------------------------------------------------------------
    def rank_kind(self, expr: ast.AST, scope: str) -> str | None:
        """'local' (LOCAL_RANK-derived), 'global' (RANK-derived) or None (unknown)."""
        return self.flow.rank_kind(expr, scope)

    def kinds(self, expr: ast.AST) -> set[str]:
        """What `expr` holds (lint_flow.py): 'local', 'global', 'envdict', 'loader'."""
        return self.flow.of(expr, self.scope_of(expr))

    # -- script-level facts ----------------------------------------------------------------
    def is_distributed(self) -> bool:
        """Does the script run as several processes (init_process_group, DDP, spawn, ...)?"""
        return any(True for _ in self.calls_to(
            "init_process_group", "init_device_mesh", "DistributedDataParallel",
            "DistributedSampler",
            "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"))

    def looks_distributed(self) -> bool:
        """Anything of torch.distributed, DDP/DataParallel, a sampler, RPC, a launcher or
        Accelerate: a script `disttrain lint` has something to say about (model files are
        skipped)."""
        if any(v.startswith(("torch.distributed", "torch.nn.parallel", "torch.multiprocessing",
                             "accelerate"))
               for v in self.aliases.values()):
            return True
        if any(True for _ in self.calls_to("DataParallel", "DistributedDataParallel",
                                           "DistributedSampler", "init_process_group")):
            return True
        return any(isinstance(n, ast.Constant) and n.value in ("LOCAL_RANK", "RANK", "torchrun")
                   for n in self.nodes) or any(
            (self.qualname(n) or "").startswith(("torch.distributed", "torch.nn.parallel"))
            for n in self.nodes if isinstance(n, ast.Attribute))

    def uses_rpc(self) -> bool:
        """An RPC program (torch.distributed.rpc): its ranks have roles, not one loop each."""
        return any(v == "torch.distributed.rpc" or v.startswith("torch.distributed.rpc.")
                   for v in self.aliases.values())

    def data_parallel(self) -> bool:
        """Does the script replicate a model over ranks (DDP, FSDP, fully_shard)?"""
        return any(True for _ in self.calls_to(
            "DistributedDataParallel", "FullyShardedDataParallel", "fully_shard"))

    def single_node(self) -> bool:
        """Rendezvous hard-wired to this machine (MASTER_ADDR = 'localhost' assigned, or a
        tcp://localhost init_method): there the global rank is the local rank."""
        loopback = ("localhost", "127.0.0.1")
        for node in self.nodes:
            if isinstance(node, ast.Assign) and literal_str(node.value) in loopback and any(
                    isinstance(t, ast.Subscript) and literal_str(t.slice) == "MASTER_ADDR"
                    for t in node.targets):
                return True
        for call in self.calls_to("init_process_group"):
            method = literal_str(keyword(call, "init_method", 1)) or ""
            if any(method.startswith(f"tcp://{h}:") for h in loopback):
                return True
        return False

    def reaches(self, node: ast.AST, names: tuple[str, ...], depth: int = 6) -> bool:
        """Does `node` call (directly or through this module's functions) one of `names`?"""
        key = (id(node), names)
        if key in self._reach_cache:
            return self._reach_cache[key]
        self._reach_cache[key] = False   # recursion: assume not
        found = False
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = self.call_name(call)
            if any(name == s or name.endswith("." + s) for s in names) or (
                    depth > 0 and any(self.reaches(fn, names, depth - 1)
                                      for fn, _ in self.flow.targets(call))):
                found = True
                break
        self._reach_cache[key] = found
        return found

    def before_process_group(self, node: ast.AST) -> bool:
        """Does `node` run before the script creates its process group: a later statement
        of an enclosing block (or of every caller) calls init_process_group (or
        init_device_mesh)?"""
        key = id(node)
        if key in self._before_cache:
            return self._before_cache[key]
        self._before_cache[key] = False   # recursion: assume not
        child, result = node, False
        for anc in self.ancestors(node):
            if isinstance(child, ast.stmt):
                for field in ("body", "orelse", "finalbody"):
                    block = getattr(anc, field, None)
                    if isinstance(block, list) and child in block and any(
                            self.reaches(s, _INITS)
                            for s in block[block.index(child) + 1:]):
                        result = True
            if result or isinstance(anc, _FUNCS):
                if not result and isinstance(anc, _FUNCS):
                    sites = self.call_sites(anc)
                    result = bool(sites) and all(self.before_process_group(c) for c in sites)
                break
            child = anc
        self._before_cache[key] = result
        return result

    def spawn_parent(self, node: ast.AST) -> bool:
        """In an mp.spawn script, code of the parent (module level, or the function that
        calls mp.spawn): it runs once, not once per worker."""
        spawns = list(self.calls_to("torch.multiprocessing.spawn",
                                    "torch.multiprocessing.start_processes"))
        if not spawns:
            return False
        func = self.function_of(node)
        return func is None or any(self.function_of(c) is func for c in spawns)

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
