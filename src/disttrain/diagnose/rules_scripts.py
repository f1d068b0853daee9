"""Rules DT019-DT022: mistakes the real scripts of pytorch/examples showed (issue 16).

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


def _scaled_backward(info: ScriptInfo, node: ast.AST) -> bool:
    """`scaler.scale(loss).backward()` inside `node`."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "backward" and isinstance(n.func.value, ast.Call)
               and isinstance(n.func.value.func, ast.Attribute)
               and n.func.value.func.attr == "scale" for n in ast.walk(node))


@rule("DT022", "clip-scaled-grads",
      "clip_grad_norm_ on GradScaler-scaled gradients without scaler.unscale_ first",
      "Call `scaler.unscale_(optimizer)` after `scaler.scale(loss).backward()` and before "
      "clipping; `scaler.step` then skips the second unscale (torch AMP docs, 'Gradient "
      "clipping').")
def dt022(info: ScriptInfo) -> Iterator[Hit]:
    for call in info.calls:
        name = info.call_name(call).split(".")[-1]
        if name not in ("clip_grad_norm_", "clip_grad_value_"):
            continue
        child: ast.AST = call
        for anc in info.ancestors(call):
            block = next((getattr(anc, f) for f in ("body", "orelse", "finalbody")
                          if isinstance(getattr(anc, f, None), list) and child in getattr(anc, f)),
                         None)
            if block is not None:
                before = block[:block.index(child)]
                scaled = [i for i, s in enumerate(before) if _scaled_backward(info, s)]
                if scaled:
                    later = before[scaled[-1]:]
                    if not any(True for s in later for n in ast.walk(s)
                               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                               and n.func.attr == "unscale_"):
                        yield (call, f"{name}() clips the SCALED gradients (after "
                                     f"scaler.scale(loss).backward(), line {before[scaled[-1]].lineno}"
                                     f"): the threshold is compared with gradients multiplied by "
                                     f"the loss scale (65536 at start), so it clips far too hard "
                                     f"or never", None)
                    break
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            child = anc
