"""Rules DT019-DT023: mistakes the real scripts of pytorch/examples showed (issue 16), and
every rank on cuda:0 (issue 25).

A split each rank draws differently, a CPU path where the model is never wrapped, a save
guarded by the local rank in a job that may span nodes, and gradient clipping on scaled
gradients. Registered in `lint_registry.py`; documented in docs/troubleshooting.md §3.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from disttrain.diagnose.lint_ctx import ScriptInfo, keyword
from disttrain.diagnose.lint_registry import Hit, rule, src

_SPLITS = {"random_split": ("generator", None), "train_test_split": ("random_state", None)}


def _seeded_globally(info: ScriptInfo) -> bool:
    """torch.manual_seed(<same on every rank>) somewhere: the default generator agrees."""
    for call in info.calls_to("torch.manual_seed"):
        arg = call.args[0] if call.args else None
        if arg is not None and not any(info.is_rank_expr(n) for n in ast.walk(arg)):
            return True
    return False


@rule("DT019", "unseeded-split",
      "random_split / train_test_split without a seeded generator in a distributed script",
      "Seed the split the same on every rank: `random_split(ds, sizes, generator=torch."
      "Generator().manual_seed(42))` (train_test_split: random_state=42), or split once "
      "before launching.")
def dt019(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed():
        return
    for call in info.calls_to(*_SPLITS):
        short = info.call_name(call).split(".")[-1]
        seed_kw = _SPLITS[short][0]
        if keyword(call, seed_kw) is not None or (short == "random_split" and len(call.args) > 2):
            continue
        if short == "random_split" and _seeded_globally(info):
            continue
        yield (call, f"{short}() without {seed_kw}=: each rank draws its own split, so one "
                     f"rank's test samples are another's training samples (and the shards of "
                     f"the DistributedSampler no longer partition one dataset)", None)


def _cuda_test(info: ScriptInfo, test: ast.AST) -> bool | None:
    """True: the test holds on GPU machines; False: on CPU ones (`not ...`); None: neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _cuda_test(info, test.operand)
        return None if inner is None else not inner
    for n in ast.walk(test):
        if isinstance(n, ast.Call) and info.call_name(n).endswith(
                ("cuda.is_available", "accelerator.is_available")):
            return True
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if name.lower() in ("use_cuda", "cuda", "use_gpu", "on_gpu", "has_cuda"):
            return True
    if isinstance(test, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "cuda"
                                             for c in test.comparators):
        return isinstance(test.ops[0], ast.Eq)
    return None


_WRAP = ("DistributedDataParallel", "FullyShardedDataParallel", "fully_shard")


@rule("DT020", "cpu-path-unwrapped",
      "the model is wrapped in DDP only on the GPU path while a process group is initialised",
      "Wrap on both paths: `DDP(model, device_ids=[local_rank] if use_cuda else None)`; on CPU "
      "DDP all-reduces the gradients over gloo.")
def dt020(info: ScriptInfo) -> Iterator[Hit]:
    if not any(True for _ in info.calls_to("init_process_group")):
        return
    wraps = list(info.calls_to(*_WRAP))
    branch_of = []
    for call in wraps:
        found = None
        child: ast.AST = call
        for anc in info.ancestors(call):
            if isinstance(anc, ast.If):
                side = _cuda_test(info, anc.test)
                if side is not None:
                    in_body = child in anc.body
                    found = (anc, side if in_body else not side)
                    break
            child = anc
        branch_of.append(found)
    if not wraps or any(b is None or not b[1] for b in branch_of):
        return   # some wrap runs on CPU too (or is not conditioned on the device)
    for call, (branch, _) in zip(wraps, branch_of):
        yield (call, f"{src(call.func)}(...) only runs when CUDA is available (line "
                     f"{branch.lineno}): on the CPU path the process group exists but the model "
                     f"is never wrapped, so each rank trains its own copy unsynchronised", None)
        return


@rule("DT021", "local-rank-save",
      "a save guarded by the local rank in a script that can run on several nodes",
      "Guard saves with the global rank (`int(os.environ['RANK']) == 0` or `dist.get_rank() "
      "== 0`); keep LOCAL_RANK for devices. If each node has its own disk and should keep a "
      "copy, put the node in the path and say so with `# disttrain: ignore[DT021]`.")
def dt021(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed() or info.single_node() or any(True for _ in info.calls_to(
            "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")):
        return   # mp.spawn and localhost rendezvous: one node, local rank = global rank
    for call in info.calls:
        name = info.call_name(call)
        is_save = name == "torch.save" or (isinstance(call.func, ast.Attribute)
                                           and call.func.attr == "save_pretrained")
        if not is_save or info.in_unused_function(call) or _to_memory(info, call):
            continue
        if info.guard_of(call) == {"local"}:
            yield (call, f"{src(call.func)}() is guarded by the LOCAL rank: under torchrun "
                         f"--nnodes N it runs once per node, and on a shared path (NFS, a "
                         f"PVC) N writers race on the same file", None)


def _to_memory(info: ScriptInfo, call: ast.Call) -> bool:
    """torch.save(obj, buffer) into an io.BytesIO: not a file."""
    target = keyword(call, "f", 1)
    if not isinstance(target, ast.Name):
        return False
    return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               and info.call_name(n.value).endswith("BytesIO")
               for n in info.assignments.get(target.id, []))


def _scaled_backward(node: ast.AST) -> ast.Call | None:
    """The last `scaler.scale(loss).backward()` call inside `node`, or None."""
    found = [n for n in ast.walk(node) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
             and isinstance(n.func.value, ast.Call)
             and isinstance(n.func.value.func, ast.Attribute)
             and n.func.value.func.attr == "scale"]
    return max(found, key=lambda n: n.lineno) if found else None


def _unscales(stmts: list[ast.stmt]) -> bool:
    """A `scaler.unscale_(...)` call among `stmts`."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "unscale_" for s in stmts for n in ast.walk(s))


@rule("DT022", "clip-scaled-grads",
      "clip_grad_norm_ on GradScaler-scaled gradients without scaler.unscale_ first",
      "Call `scaler.unscale_(optimizer)` after `scaler.scale(loss).backward()` and before "
      "clipping; `scaler.step` then skips the second unscale (torch AMP docs, 'Gradient "
      "clipping').")
def dt022(info: ScriptInfo) -> Iterator[Hit]:
    """From the clip outwards, block by block, to the block that holds the scaled backward:
    an unscale_ in any of those blocks before the path to the clip counts (`if clip:
    scaler.unscale_(opt); clip_grad_norm_(...)` unscales in the clip's own block)."""
    for call in info.calls:
        name = info.call_name(call).split(".")[-1]
        if name not in ("clip_grad_norm_", "clip_grad_value_"):
            continue
        child: ast.AST = call
        unscaled = False
        for anc in info.ancestors(call):
            block = next((getattr(anc, f) for f in ("body", "orelse", "finalbody")
                          if isinstance(getattr(anc, f, None), list) and child in getattr(anc, f)),
                         None)
            if block is not None:
                before = block[:block.index(child)]
                backwards = [(i, b) for i, s in enumerate(before)
                             if (b := _scaled_backward(s)) is not None]
                if backwards:
                    at, backward = backwards[-1]
                    if not unscaled and not _unscales(before[at:]):
                        yield (call, f"{name}() clips the SCALED gradients (after "
                                     f"scaler.scale(loss).backward(), line {backward.lineno}"
                                     f"): the threshold is compared with gradients multiplied by "
                                     f"the loss scale (65536 at start), so it clips far too hard "
                                     f"or never", None)
                    break
                unscaled = unscaled or _unscales(before)
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            child = anc


# -- DT023 --------------------------------------------------------------------------------
# What chooses a GPU per process: any of these and `.cuda()` means that process's GPU.
_CHOOSERS = ("cuda.set_device", "set_device_index", "set_device_idx", "torch.cuda.device",
             "xpu.set_device", "init_device_mesh")
# libraries that bind each process to its device themselves
_DEVICE_LIBS = ("accelerate.", "lightning.", "pytorch_lightning.", "transformers.")


def _default_cuda(info: ScriptInfo, expr: ast.AST | None) -> bool:
    """`"cuda"`, `torch.device("cuda")`, or a name only ever bound to one of them (or to
    `"cuda" if ... else "cpu"`): the current device, which nobody set."""
    if expr is None:
        return False
    if isinstance(expr, ast.Constant):
        return expr.value == "cuda"
    if isinstance(expr, ast.IfExp):
        return _default_cuda(info, expr.body) or _default_cuda(info, expr.orelse)
    if isinstance(expr, ast.Call):
        return info.call_name(expr) == "torch.device" and len(expr.args) == 1 and \
            not expr.keywords and _default_cuda(info, expr.args[0])
    if isinstance(expr, ast.Name):
        values = [n.value for n in info.assignments.get(expr.id, []) if isinstance(n, ast.Assign)]
        return bool(values) and all(_default_cuda(info, v) for v in values)
    return False


def _chooses_device(info: ScriptInfo) -> bool:
    """The script binds each process to a GPU somewhere, or names one by index."""
    for call in info.calls:
        name = info.call_name(call)
        if any(name.endswith(c) for c in _CHOOSERS) or name.startswith(_DEVICE_LIBS) or any(
                k.arg == "device_ids" for k in call.keywords):
            return True
        if name == "torch.device" and len(call.args) > 1:
            return True   # torch.device("cuda", local_rank)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "cuda" and (
                call.args or call.keywords):
            return True   # .cuda(local_rank)
        if isinstance(call.func, ast.Attribute) and call.func.attr == "to" and call.args \
                and (type(getattr(call.args[0], "value", None)) is int
                     or info.is_rank_expr(call.args[0])):
            return True   # .to(rank)
    for node in info.nodes:
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            else None
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(
                node.values[0], ast.Constant):
            text = str(node.values[0].value)
        if text is not None and (text.startswith("cuda:") or text == "CUDA_VISIBLE_DEVICES"):
            return True   # f"cuda:{local_rank}", or one visible GPU per process
    return False


def _default_device_uses(info: ScriptInfo) -> list[ast.Call]:
    """`.cuda()`, `.to("cuda")`, `.to(device)` with device = torch.device("cuda"), ...:
    moves to the current device."""
    found = []
    for call in info.calls:
        func = call.func
        if not isinstance(func, ast.Attribute):
            continue
        bare_cuda = func.attr == "cuda" and not call.args and not call.keywords
        if bare_cuda or (func.attr == "to" and _default_cuda(info, keyword(call, "device", 0))):
            found.append(call)
    return found


@rule("DT023", "default-cuda-device",
      "every rank uses cuda:0: .cuda() / 'cuda' with no torch.cuda.set_device and no index",
      "Bind each rank to its GPU before anything touches CUDA: `local_rank = "
      "int(os.environ['LOCAL_RANK'])`, `torch.cuda.set_device(local_rank)` (then `.cuda()` and "
      "'cuda' mean that GPU), and `DDP(model, device_ids=[local_rank])`.")
def dt023(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed() or info.uses_rpc():
        return
    uses = _default_device_uses(info)
    if not uses or _chooses_device(info):
        return
    first = min(uses, key=lambda c: c.lineno)
    yield (first, f"{src(first)} moves to the current CUDA device, and nothing in the script "
                  f"chooses one per rank (no torch.cuda.set_device, no device index): every "
                  f"process of a node uses cuda:0, so with --nproc-per-node N the ranks share "
                  f"GPU 0 (NCCL: Duplicate GPU detected, or GPU 0 runs out of memory while "
                  f"the others idle)", None)
