"""The checklist rules DT001-DT005: the guide's checklist (DDP not DataParallel, a backend
that fits the device, set_epoch, saving on one rank, LR scaling), one function each;
registered in `lint_registry.py`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from disttrain.diagnose.lint_ctx import ScriptInfo, argparse_default, keyword, literal_str
from disttrain.diagnose.lint_locals import local_modules, overrides_print
from disttrain.diagnose.lint_registry import Hit, rule, src


@rule("DT001", "dataparallel",
      "nn.DataParallel where DistributedDataParallel fits (checklist: DDP, not DataParallel)",
      "Use DistributedDataParallel with one process per GPU, started by torchrun "
      "(`disttrain run script.py`); it overlaps gradient all-reduce with backward and "
      "works across nodes.")
def dt001(info: ScriptInfo) -> Iterator[Hit]:
    for call in info.calls_to("DataParallel"):
        yield (call, "nn.DataParallel runs one process with a thread per GPU: the GIL limits "
                     "it, GPU 0 gathers every output, and it cannot span nodes", None)


_CPU_PATH_FIX = ('Choose the backend where the device is chosen: `dist.init_process_group('
                 '"nccl" if torch.cuda.is_available() else "gloo")`.')


def _has_cpu_path(info: ScriptInfo) -> bool:
    """The script asks whether CUDA is there and names a CPU device: it means to run on CPU."""
    asks = any(info.call_name(c).endswith("cuda.is_available") for c in info.calls)
    cpu = any(isinstance(n, ast.Constant) and n.value == "cpu" for n in info.nodes)
    return asks and cpu


def _named_backend(info: ScriptInfo, call: ast.Call, given: ast.AST | None) -> ast.AST | None:
    """`backend = "nccl"` then `init_process_group(backend=backend)`: the literal a name
    holds when every assignment of it (in the call's function, else the module) gives that
    one literal; None otherwise."""
    if not isinstance(given, ast.Name):
        return None
    nodes = info.assignments.get(given.id, [])
    scope = info.function_of(call)
    values = [n for n in nodes if info.function_of(n) is scope] or [
        n for n in nodes if info.function_of(n) is None]
    if not values or not all(isinstance(n, ast.Assign) and literal_str(n.value) is not None
                             for n in values):
        return None
    literals = {literal_str(n.value) for n in values}   # type: ignore[attr-defined]
    return values[0].value if len(literals) == 1 else None   # type: ignore[attr-defined]


@rule("DT002", "backend-device",
      "nccl backend in code that never uses a GPU or that also runs on CPU, or gloo in code "
      "that trains on GPUs",
      "Choose the backend from the device: backend='nccl' if torch.cuda.is_available() else "
      "'gloo', or let torchrun/disttrain pick (--backend auto).")
def dt002(info: ScriptInfo) -> Iterator[Hit]:
    inits = list(info.calls_to("init_process_group"))
    backends = {(literal_str(_named_backend(info, c, keyword(c, "backend", 0))
                             or keyword(c, "backend", 0)) or "?").lower() for c in inits}
    if len(backends) > 1:
        return   # the backend is chosen per branch: each literal is a deliberate fallback
    for call in inits:
        world = keyword(call, "world_size", 3)
        if isinstance(world, ast.Constant) and world.value == 1:
            continue   # a one-process group: the backend never moves data
        given = keyword(call, "backend", 0)
        default = argparse_default(info, given) if given is not None else None
        if default is not None and (literal_str(default) or "").lower() == "nccl" \
                and _has_cpu_path(info):
            yield (call, f'{src(given)} defaults to "nccl" (argparse, line {default.lineno}), '
                         f'but the script also has a CPU path (torch.cuda.is_available() ... '
                         f'"cpu"): run without the flag on a machine without GPUs, '
                         f'init_process_group("nccl") fails before that path is reached',
                   "Make the default follow the device: `default=None`, then `backend = "
                   'args.backend or ("nccl" if torch.cuda.is_available() else "gloo")`.')
            continue
        named = _named_backend(info, call, given)
        backend = (literal_str(named or given) or "").lower()
        if named is not None and backend == "nccl" and _has_cpu_path(info):
            yield (call, f'{src(given)} is "nccl" (line {named.lineno}), but the script also '
                         f'has a CPU path (torch.cuda.is_available() ... "cpu"): on a machine '
                         f'without GPUs init_process_group("nccl") fails before that path is '
                         f'reached', _CPU_PATH_FIX)
            continue
        if backend == "nccl" and not info.uses_gpu():
            yield (call, 'backend="nccl" but the script never puts a tensor on a GPU: NCCL '
                         'only moves CUDA tensors ("No backend type associated with device '
                         'type cpu")', None)
        elif backend == "nccl" and _has_cpu_path(info):
            yield (call, 'backend="nccl" is hard-coded, but the script also has a CPU path '
                         '(torch.cuda.is_available() ... "cpu"): on a machine without GPUs '
                         'init_process_group("nccl") fails before that path is reached',
                   _CPU_PATH_FIX)
        elif backend == "gloo" and info.trains_on_gpu() and not (
                info.uses_rpc() and not info.data_parallel()):   # RPC moves the tensors
            yield (call, 'backend="gloo" in a script that trains on GPUs: gloo copies every '
                         'gradient through the CPU and is several times slower than NCCL',
                   None)


# -- DT003 --------------------------------------------------------------------------------
_WRAPPERS = ("enumerate", "tqdm", "iter", "zip", "islice", "track", "progress_bar")


def _loaderish(info: ScriptInfo, expr: ast.AST, loaders: set[str]) -> bool:
    while isinstance(expr, ast.Call) and expr.args and \
            info.call_name(expr).split(".")[-1] in _WRAPPERS:
        expr = expr.args[0]
    if "loader" in info.kinds(expr):   # followed through assignments, self., arguments
        return True
    if isinstance(expr, ast.Name):
        return expr.id in loaders or "loader" in expr.id.lower()
    if isinstance(expr, ast.Attribute):
        return "loader" in expr.attr.lower()
    if isinstance(expr, ast.Call):
        name = info.call_name(expr).split(".")[-1]
        return name.endswith("DataLoader") or "loader" in name.lower()
    return False


def _nearest_loop(info: ScriptInfo, node: ast.AST) -> ast.AST | None:
    for anc in info.ancestors(node):
        if isinstance(anc, (ast.For, ast.While, ast.AsyncFor)):
            return anc
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
    return None


def _epoch_loops(info: ScriptInfo, loaders: set[str]) -> list[ast.AST]:
    """Loops that iterate a data loader once per pass: the epoch loops (the loader loop
    may sit in a function or method the epoch loop calls, as in the DDP tutorial)."""
    loops: list[ast.AST] = []
    pending = [n for n in info.nodes
               if isinstance(n, (ast.For, ast.AsyncFor)) and _loaderish(info, n.iter, loaders)]
    seen_funcs: set[int] = set()
    while pending:
        node = pending.pop()
        loop = _nearest_loop(info, node)
        if loop is not None:
            if loop not in loops:
                loops.append(loop)
            continue
        func = info.function_of(node)   # the loader loop is a function called per epoch
        if func is None or id(func) in seen_funcs:
            continue
        seen_funcs.add(id(func))
        pending += info.call_sites(func)
    return sorted(loops, key=lambda n: n.lineno)


def _sets_epoch(info: ScriptInfo, loop: ast.AST) -> bool:
    """Does each pass of `loop` call set_epoch (itself or in what it calls), or hand a
    sampler or loader to a function this module does not define (it may set it)?"""
    if info.reaches(loop, ("set_epoch",)):
        return True
    for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call)):
        if any(True for _ in info.flow.targets(call)):
            continue
        args = [*call.args, *(k.value for k in call.keywords)]
        if any("sampler" in ast.unparse(a).lower() for a in args):
            return True
    return False


@rule("DT003", "set-epoch",
      "a DistributedSampler whose loader is iterated every epoch without set_epoch",
      "Call `sampler.set_epoch(epoch)` (or `loader.sampler.set_epoch(epoch)`) at the start "
      "of every epoch, before iterating the loader (deployment guide §5.1: 必须调用).")
def dt003(info: ScriptInfo) -> Iterator[Hit]:
    samplers = list(info.calls_to("DistributedSampler"))
    if not samplers:
        return
    loaders = {t.id for n in info.nodes if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Call)
               and info.call_name(n.value).endswith("DataLoader")
               for t in n.targets if isinstance(t, ast.Name)}
    for loop in _epoch_loops(info, loaders):
        if _sets_epoch(info, loop):
            continue
        yield (loop, f"this loop iterates the data loader every pass, but the "
                     f"DistributedSampler (line {samplers[0].lineno}) never gets "
                     f"set_epoch(epoch): every epoch repeats the same shuffled order", None)


# -- DT004 --------------------------------------------------------------------------------
def _mentions_rank(info: ScriptInfo, call: ast.Call) -> bool:
    return any(info.is_rank_expr(n) for arg in [*call.args, *(k.value for k in call.keywords)]
               for n in ast.walk(arg))


def _output_kind(info: ScriptInfo, call: ast.Call) -> str | None:
    name = info.call_name(call)
    if name == "torch.save":
        return "save"
    if name == "print":
        return "print"
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = (info.qualname(func.value) or "").lower()
        if func.attr == "info" and ("log" in owner.split(".")[-1] or owner ==
                                                "logging"):
            return "log"
        if func.attr.startswith("add_") and any(w in owner.split(".")[-1]
                                                for w in ("writer", "tb", "summary")):
            return "log"
        if name in ("wandb.log", "wandb.init") or name.startswith("mlflow.log_"):
            return "log"
        if func.attr == "save_pretrained":
            return "save"
    return None


_DT004 = {
    "save": ("{what} runs on every rank: all ranks write the same file at the same time (a "
             "race that can leave a corrupt file)",
             "Save only on rank 0: `if dist.get_rank() == 0: ...` (checklist: 只在 rank 0 保存模型和"
             "日志), then dist.barrier() if other ranks read it."),
    "print": ("print() runs on every rank: each line is printed once per process",
              "Print only on rank 0 (`if rank == 0:`), or put the rank in the message if every "
              "rank must report."),
    "log": ("{what} runs on every rank: every metric is logged once per process",
            "Log only on rank 0 (`if rank == 0:`); average metrics across ranks with "
            "dist.all_reduce first if they should describe the whole job."),
}


def _uses_accelerate(info: ScriptInfo) -> bool:
    """An `accelerate.Accelerator()`: `accelerate launch` starts one process per device."""
    return any(name.startswith("accelerate.") and name.endswith("Accelerator")
               for name in map(info.call_name, info.calls))


def _print_overridden(info: ScriptInfo) -> bool:
    """`builtins.print` replaced by one that prints on rank 0 only (setup_for_distributed
    of the vision codebases), in the script or in a local module it imports."""
    return overrides_print(info.tree) or any(
        overrides_print(tree) for tree in local_modules(info.path, info.tree))


_ACCELERATE_PRINT_FIX = ("Use `accelerator.print(...)` (prints on the main process only) or "
                         "guard it with `if accelerator.is_main_process:`.")


@rule("DT004", "rank0-output",
      "saving, printing or logging without a rank-0 guard",
      "Wrap it in `if dist.get_rank() == 0:` (checklist: save and log only on rank 0).")
def dt004(info: ScriptInfo) -> Iterator[Hit]:
    accelerate = _uses_accelerate(info)
    if not (info.is_distributed() or accelerate) or info.uses_rpc():
        return   # an RPC program's ranks have roles: each reports its own work
    print_once: bool | None = None   # read the local modules only when a print needs it
    for call in info.calls:
        kind = _output_kind(info, call)
        if kind is None or info.guarded(call) or info.in_except(call) \
                or info.in_unused_function(call):
            continue
        if kind == "log" and accelerate:
            continue   # accelerate.logging's loggers log on the main process by default
        if kind == "print":
            if print_once is None:
                print_once = _print_overridden(info)
            if print_once:
                continue   # the override prints once, on rank 0
        if kind != "save" and (info.spawn_parent(call) or info.before_process_group(call)):
            continue   # spawn's parent prints once; before init_process_group, no job yet
        if kind == "print" and _mentions_rank(info, call):
            continue   # per-rank messages are meant
        message, fix = _DT004[kind]
        if kind == "print" and accelerate:
            fix = _ACCELERATE_PRINT_FIX
        yield call, message.format(what=src(call.func) + "()"), fix


# -- DT005 --------------------------------------------------------------------------------
_OPTIMIZERS = {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam",
               "RAdam", "SparseAdam", "LBFGS", "Lion", "LAMB", "Lamb", "LARS", "Adafactor"}


def _constant_number(info: ScriptInfo, expr: ast.AST, scope_node: ast.AST | None,
                     depth: int = 4) -> float | None:
    """A numeric literal, a name only ever assigned one (in its scope, else the module), or
    `args.lr` whose argparse default is one and that nothing reassigns."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, (int, float)) \
            and not isinstance(expr.value, bool):
        return float(expr.value)
    if depth <= 0:
        return None
    if isinstance(expr, ast.Attribute):
        default = argparse_default(info, expr)
        return _constant_number(info, default, None, 0) if default is not None else None
    if not isinstance(expr, ast.Name):
        return None
    nodes = info.assignments.get(expr.id, [])
    local = [n for n in nodes if info.function_of(n) is scope_node]
    values = local or [n for n in nodes if info.function_of(n) is None]
    if not values or any(isinstance(n, ast.AugAssign) or getattr(n, "value", None) is None
                         for n in values):
        return None
    nums = [_constant_number(info, n.value, scope_node, depth - 1) for n in values]
    return nums[0] if all(x is not None for x in nums) else None


@rule("DT005", "lr-scaling",
      "learning rate not scaled with the world size (checklist: lr = base_lr * world_size)",
      "Scale it: `lr = base_lr * dist.get_world_size()` (linear scaling, deployment guide §7.2; add "
      "warmup for large world sizes), or keep the global batch fixed; if this lr was tuned "
      "for this world size, say so with `# disttrain: ignore[DT005]`.")
def dt005(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed() or not info.data_parallel() or info.uses_rpc():
        return   # only replicas that average gradients see an N-times larger batch
    for call in info.calls:
        name = info.call_name(call)
        short = name.split(".")[-1]
        if short not in _OPTIMIZERS or not (name.startswith("torch.optim") or name == short
                                            or "optim" in name):
            continue
        lr = keyword(call, "lr", 1)
        if lr is None:
            continue
        value = _constant_number(info, lr, info.function_of(call))
        if value is not None:
            shown = src(lr) if isinstance(lr, ast.Constant) else f"{src(lr)} (= {value:g})"
            yield (call, f"lr={shown} is not scaled with the world size: with N ranks the "
                         f"global batch is N times larger, so each step averages over more "
                         f"samples", None)
