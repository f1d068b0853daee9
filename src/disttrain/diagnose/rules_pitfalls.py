"""Rules beyond the checklist (DT011-DT018): mistakes seen in real scripts and bug reports.

Each is here because it is precise (a pattern that is wrong wherever it appears) and
because the failure it prevents is expensive: a checkpoint that does not load, every rank
loading onto GPU 0, a job that collides with its neighbour's port, mp.spawn workers
that cannot find the master.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from disttrain.diagnose.lint_ctx import ScriptInfo, keyword, literal_str
from disttrain.diagnose.lint_registry import Hit, rule, src

_AMP = ("torch.cuda.amp", "torch.cpu.amp")


@rule("DT011", "deprecated-amp",
      "torch.cuda.amp.autocast / GradScaler (deprecated since torch 2.4)",
      "Use torch.amp.autocast('cuda', dtype=torch.bfloat16) and torch.amp.GradScaler('cuda') "
      "(the guide's §7.3 spelling warns on current torch).")
def dt011(info: ScriptInfo) -> Iterator[Hit]:
    for node in info.nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module in _AMP or (node.module in ("torch.cuda", "torch.cpu")
                                        and any(a.name == "amp" for a in node.names))):
            yield node, f"imports from {node.module}, the deprecated AMP namespace", None
    for call in info.calls:
        name = info.call_name(call)
        if any(name.startswith(m + ".") for m in _AMP) and isinstance(call.func, ast.Attribute):
            yield call, f"{src(call.func)}() is deprecated", None


# -- DT012 / DT013: what a torch.load reads ---------------------------------------------------
_SAVE_WRAPPERS = ("save_on_master", "save_on_main", "save_on_main_process", "save_on_rank0")
_DATASETS = ("Dataset", "ImageFolder", "DatasetFolder")
_PATHISH = re.compile(r"(?:dir|path|root|name|file)s?$", re.IGNORECASE)


@dataclass(frozen=True)
class _Saved:
    """What one save in the script writes: the path expression, the objects in it that
    are not tensors (described), whether it holds tensors, and its dict keys."""

    call: ast.Call
    path: ast.AST | None
    others: tuple[str, ...]
    tensors: bool
    keys: frozenset[str]


def _is_args(info: ScriptInfo, name: str) -> bool:
    """A name bound to argparse's result (`args = parser.parse_args()`, or called `args`)."""
    return name == "args" or any(
        isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Attribute)
        and n.value.func.attr in ("parse_args", "parse_known_args")
        for n in info.assignments.get(name, []))


def _is_dataset(info: ScriptInfo, name: str) -> bool:
    if "dataset" in name.lower():
        return True
    return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               and info.call_name(n.value).endswith(_DATASETS)
               for n in info.assignments.get(name, []))


def _contents(info: ScriptInfo, expr: ast.AST, scope: ast.AST | None, depth: int = 2
              ) -> tuple[list[str], bool, set[str]]:
    """(non-tensor objects named, holds tensors, dict keys) of a saved expression,
    following a name to the dict or tuple it was built as (in the same function)."""
    if isinstance(expr, (ast.Tuple, ast.List, ast.Dict)):
        parts = expr.values if isinstance(expr, ast.Dict) else expr.elts
        others: list[str] = []
        tensors = False
        keys = {k.value for k in getattr(expr, "keys", []) if isinstance(k, ast.Constant)
                and isinstance(k.value, str)}
        for part in parts:
            o, t, _ = _contents(info, part, scope, depth)
            others += o
            tensors = tensors or t
        return others, tensors, keys
    if isinstance(expr, ast.Name):
        if _is_args(info, expr.id):
            return [f"{expr.id} (an argparse Namespace)"], False, set()
        if _is_dataset(info, expr.id):
            return [f"{expr.id} (a Dataset object)"], False, set()
        built = [n for n in info.assignments.get(expr.id, []) if isinstance(n, ast.Assign)
                 and info.function_of(n) is scope and n.lineno < expr.lineno
                 and isinstance(n.value, (ast.Dict, ast.Tuple))]
        if depth > 0 and built:   # the dict or tuple it was last built as
            return _contents(info, built[-1].value, scope, depth - 1)
        if _PATHISH.search(expr.id):
            return [], False, set()   # a folder or file name saved with a cache
    if isinstance(expr, (ast.Constant, ast.JoinedStr)):
        return [], False, set()
    return [], True, set()   # a state_dict, a tensor, or unknown: may hold tensors


def _saves(info: ScriptInfo) -> list[_Saved]:
    out = []
    for call in info.calls:
        name = info.call_name(call)
        if name != "torch.save" and not name.endswith(_SAVE_WRAPPERS):
            continue
        obj = keyword(call, "obj", 0)
        if obj is None:
            continue
        others, tensors, keys = _contents(info, obj, info.function_of(call))
        out.append(_Saved(call, keyword(call, "f", 1), tuple(others), tensors,
                          frozenset(keys)))
    return out


def _loaded_as(info: ScriptInfo, call: ast.Call) -> tuple[list[str], set[str]]:
    """How the script uses what a torch.load returns: names it unpacks into a Dataset
    (`dataset, _ = torch.load(cache_path)`), and the keys it reads (`ckpt["model"]`)."""
    parent = info.parents.get(call)
    if not isinstance(parent, ast.Assign) or len(parent.targets) != 1:
        return [], set()
    target = parent.targets[0]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [f"{t.id} (a Dataset object)" for t in target.elts
                if isinstance(t, ast.Name) and "dataset" in t.id.lower()], set()
    if not isinstance(target, ast.Name):
        return [], set()
    scope = info.function_of(call)
    keys = {n.slice.value for n in info.nodes if isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Name) and n.value.id == target.id
            and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
            and info.function_of(n) is scope}
    return [], keys


def _same_path(a: ast.AST | None, b: ast.AST | None) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def _reads(info: ScriptInfo, call: ast.Call) -> tuple[list[str], bool, int | None]:
    """(the non-tensor objects a torch.load reads, whether it may read tensors, the line
    of the save it reads): from how its result is used and from the script's saves of
    the same path, or of a dict with the keys the load reads."""
    unpacked, keys = _loaded_as(info, call)
    if unpacked:
        return unpacked, False, None
    path = keyword(call, "f", 0)
    matched = [s for s in _saves(info) if _same_path(s.path, path)
               or (keys and s.keys and keys <= s.keys)]
    others = [o for s in matched for o in s.others]
    if not matched or not others:
        return [], True, None
    return others, any(s.tensors for s in matched), matched[0].call.lineno


@rule("DT012", "torch-load-weights-only",
      "torch.load without weights_only=True",
      "Pass weights_only=True (loads tensors and plain containers only; the default since "
      "torch 2.6, but not in the guide's torch 2.1 image, where a checkpoint can run code).")
def dt012(info: ScriptInfo) -> Iterator[Hit]:
    for call in info.calls_to("torch.load"):
        if keyword(call, "weights_only") is not None:
            continue
        others, _, line = _reads(info, call)
        if not others:
            yield (call, "torch.load() without weights_only=True unpickles arbitrary objects "
                         "(older torch runs code from the file)", None)
            continue
        what = ", ".join(dict.fromkeys(others))
        saved = f" (saved at line {line})" if line else ""
        yield (call, f"torch.load() reads objects that are not tensors{saved}: {what}; "
                     f"weights_only=True cannot load them, and since torch 2.6 that is the "
                     f"default, so this load fails there",
               "Save plain data instead (`vars(args)`, tensors, lists, dicts) and load with "
               "weights_only=True; or, for a file this job wrote itself, say so with an "
               "explicit weights_only=False (never for a file from elsewhere: it can run "
               "code).")


@rule("DT013", "torch-load-map-location",
      "torch.load without map_location in a multi-GPU script",
      "Pass map_location='cpu' (then move to the device) or "
      "map_location=f'cuda:{local_rank}'.")
def dt013(info: ScriptInfo) -> Iterator[Hit]:
    if not (info.is_distributed() and info.uses_gpu()):
        return
    for call in info.calls_to("torch.load"):
        if keyword(call, "map_location", 1) is None and _reads(info, call)[1]:
            yield (call, "torch.load() without map_location puts CUDA tensors back on the GPU "
                         "they were saved from (usually cuda:0) on every rank: GPU 0 fills up",
                   None)


def _environ_sets(info: ScriptInfo) -> Iterator[tuple[ast.AST, str, ast.AST]]:
    """(node, key, value) for os.environ[KEY] = value and os.environ.update({...})."""
    for node in info.nodes:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and (info.qualname(t.value) or "").endswith(
                        "environ"):
                    key = literal_str(t.slice)
                    if key:
                        yield node, key, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("update", "setdefault") \
                and (info.qualname(node.func.value) or "").endswith("environ"):
            if node.func.attr == "setdefault" and len(node.args) == 2:
                key = literal_str(node.args[0])
                if key:
                    yield node, key, node.args[1]
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    for k, v in zip(arg.keys, arg.values):
                        if literal_str(k):
                            yield node, literal_str(k) or "", v


@rule("DT014", "hardcoded-master",
      "MASTER_PORT (or, under torchrun, MASTER_ADDR) hard-coded in os.environ",
      "Let the launcher set them (torchrun --master-port / the pod spec); in an mp.spawn "
      "script use os.environ.setdefault('MASTER_PORT', ...) or pick a free port at start.")
def dt014(info: ScriptInfo) -> Iterator[Hit]:
    spawn = any(True for _ in info.calls_to("torch.multiprocessing.spawn"))
    for node, key, value in _environ_sets(info):
        if not isinstance(value, ast.Constant) or (
                isinstance(node, ast.Call) and node.func.attr == "setdefault"):
            continue
        if key == "MASTER_PORT":
            yield (node, f"hard-codes MASTER_PORT={value.value!r}: two jobs on one node then "
                         f"collide (Address already in use, deployment guide §8.3), and it overrides "
                         f"what torchrun or the pod spec sets", None)
        elif key == "MASTER_ADDR" and not spawn:
            yield (node, f"hard-codes MASTER_ADDR={value.value!r}, overriding the address "
                         f"torchrun or the pod spec gives (multi-node jobs then cannot meet)",
                   None)


@rule("DT015", "sampler-local-rank",
      "DistributedSampler(rank=...) given the local rank",
      "Let the sampler ask the process group (omit num_replicas= and rank=), or pass "
      "rank=dist.get_rank().")
def dt015(info: ScriptInfo) -> Iterator[Hit]:
    for call in info.calls_to("DistributedSampler"):
        rank = keyword(call, "rank", 2)
        if rank is not None and info.rank_kind(rank, info.scope_of(call)) == "local":
            yield (call, f"DistributedSampler(rank={src(rank)}) gets the LOCAL rank: on more "
                         f"than one node, ranks with the same local rank read the same shard "
                         f"and part of the data is never seen", None)


@rule("DT016", "loader-without-sampler",
      "DataLoader(shuffle=True) without a DistributedSampler under DDP",
      "Give the training loader sampler=DistributedSampler(dataset) (shuffling moves to the "
      "sampler) and call sampler.set_epoch(epoch) every epoch.")
def dt016(info: ScriptInfo) -> Iterator[Hit]:
    if not any(True for _ in info.calls_to("DistributedDataParallel", "init_process_group")):
        return
    for call in info.calls_to("DataLoader"):
        shuffle = keyword(call, "shuffle", 2)
        if not (isinstance(shuffle, ast.Constant) and shuffle.value is True):
            continue
        if keyword(call, "sampler") is None and keyword(call, "batch_sampler") is None:
            yield (call, "DataLoader(shuffle=True) without a DistributedSampler: every rank "
                         "iterates the whole dataset, so N ranks do N times the work of one "
                         "epoch", None)


@rule("DT017", "ddp-state-dict",
      "saving the DDP wrapper's state_dict (keys prefixed with 'module.')",
      "Save the unwrapped model: torch.save(model.module.state_dict(), path).")
def dt017(info: ScriptInfo) -> Iterator[Hit]:
    wrapped: dict[str, list[tuple[ast.AST | None, int]]] = {}
    for node in info.nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                info.call_name(node.value).endswith("DistributedDataParallel"):
            for t in node.targets:
                name = info.qualname(t)
                if name:
                    wrapped.setdefault(name, []).append((info.function_of(node), node.lineno))
    if not wrapped:
        return
    for call in info.calls:
        name = info.call_name(call)
        if name != "torch.save" and not name.endswith(_SAVE_WRAPPERS):
            continue
        obj = keyword(call, "obj", 0)
        scope = info.function_of(call)
        for node in _saved_nodes(info, obj, scope):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "state_dict"):
                continue
            owner = info.qualname(node.func.value)
            if owner in wrapped and any(_wrapped_before(info, fn, line, scope, call, owner)
                                        for fn, line in wrapped[owner]):
                yield (call, f"saves {owner}.state_dict() of the DDP wrapper: every key starts "
                             f"with 'module.', so it does not load into the plain model", None)
                break


def _saved_nodes(info: ScriptInfo, obj: ast.AST | None, scope: ast.AST | None
                 ) -> list[ast.AST]:
    """The nodes of a saved object, and of the dict or tuple a saved name was built as in
    the same function (`ckpt = {"model": model.state_dict()}; torch.save(ckpt, p)`)."""
    if obj is None:
        return []
    nodes = list(ast.walk(obj))
    if isinstance(obj, ast.Name):
        for n in info.assignments.get(obj.id, []):
            if isinstance(n, ast.Assign) and info.function_of(n) is scope and isinstance(
                    n.value, (ast.Dict, ast.Tuple, ast.Call)):
                nodes += list(ast.walk(n.value))
    return nodes


def _wrapped_before(info: ScriptInfo, fn: ast.AST | None, line: int, scope: ast.AST | None,
                    call: ast.Call, owner: str) -> bool:
    """The wrap reaches the save: earlier in its function or at module level, or, for
    `self.model = DDP(...)`, in another method of the same class."""
    if (fn is scope or fn is None) and line < call.lineno:
        return True
    if owner.startswith("self.") and fn is not None and scope is not None:
        return info.parents.get(fn) is info.parents.get(scope) and isinstance(
            info.parents.get(fn), ast.ClassDef)
    return False


@rule("DT018", "spawn-master-env",
      "mp.spawn workers call init_process_group without MASTER_ADDR/MASTER_PORT set",
      "Before mp.spawn set os.environ.setdefault('MASTER_ADDR', '127.0.0.1') and a free "
      "MASTER_PORT, or pass init_method='tcp://127.0.0.1:PORT', or launch with torchrun.")
def dt018(info: ScriptInfo) -> Iterator[Hit]:
    if not any(True for _ in info.calls_to("torch.multiprocessing.spawn")):
        return
    keys = {key for _, key, _ in _environ_sets(info)}
    if {"MASTER_ADDR", "MASTER_PORT"} <= keys:
        return
    for call in info.calls_to("init_process_group"):
        if keyword(call, "init_method", 1) is None and keyword(call, "store") is None:
            missing = " and ".join(k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in keys)
            yield (call, f"the mp.spawn workers rendezvous through env:// but the script never "
                         f"sets {missing}: init fails with 'environment variable {missing.split()[0]} "
                         f"expected, but not set' unless the shell exports it", None)
            return
