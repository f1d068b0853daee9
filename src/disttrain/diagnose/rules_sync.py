"""Rules DT006-DT010 on synchronisation and devices: barriers, the device of each rank, the
launcher, teardown, downloads by every rank."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from disttrain.diagnose.lint_ctx import ScriptInfo, keyword, literal_str
from disttrain.diagnose.lint_registry import Hit, rule, src

_BARRIERS = ("barrier", "monitored_barrier", "wait_for_everyone")


# -- DT006 --------------------------------------------------------------------------------
def _mode(call: ast.Call) -> str:
    return literal_str(keyword(call, "mode", 1)) or "r"


def _write_path(info: ScriptInfo, call: ast.Call) -> tuple[bool, ast.AST | None, str | None]:
    """(is a file write, its path expression, the dataset class for download=True)."""
    name = info.call_name(call)
    if name == "torch.save":
        return True, keyword(call, "f", 1), None
    if name == "open":
        return any(c in _mode(call) for c in "wax"), keyword(call, "file", 0), None
    if name.endswith(("numpy.save", "json.dump")) or (
            isinstance(call.func, ast.Attribute) and call.func.attr == "save_pretrained"):
        return True, call.args[0] if call.args else None, None
    download = keyword(call, "download")
    if isinstance(download, ast.Constant) and download.value is True:
        return True, keyword(call, "root", 0), name
    return False, None, None


def _read_path(info: ScriptInfo, call: ast.Call, datasets: set[str]) -> tuple[bool, ast.AST | None]:
    name = info.call_name(call)
    if name == "torch.load":
        return True, keyword(call, "f", 0)
    if name == "open":
        return not any(c in _mode(call) for c in "wax"), keyword(call, "file", 0)
    if name.endswith(("numpy.load", "json.load", "pandas.read_csv")) or (
            isinstance(call.func, ast.Attribute) and call.func.attr == "from_pretrained"):
        return True, call.args[0] if call.args else None
    if name in datasets:
        download = keyword(call, "download")
        if not (isinstance(download, ast.Constant) and download.value is True):
            return True, keyword(call, "root", 0)
    return False, None


def _same_file(a: ast.AST | None, b: ast.AST | None) -> bool:
    """Unknown counts as the same; two different literal paths do not."""
    if a is None or b is None:
        return True
    la, lb = literal_str(a), literal_str(b)
    if la is not None and lb is not None:
        return la == lb
    return True


@rule("DT006", "barrier",
      "no barrier between rank 0 writing a file and the other ranks reading it",
      "Call dist.barrier() after the rank-0 block, on every rank (checklist: 使用 "
      "dist.barrier() 同步关键操作), so nobody reads a half-written file.")
def dt006(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed():
        return
    writes, datasets = [], set()
    for call in info.calls:
        is_write, path, dataset = _write_path(info, call)
        if is_write and info.guarded(call):
            writes.append((call, path))
            if dataset:
                datasets.add(dataset)
    if not writes:
        return
    barriers = [c for c in info.calls
                if (isinstance(c.func, ast.Attribute) and c.func.attr in _BARRIERS)
                or (isinstance(c.func, ast.Name) and c.func.id in _BARRIERS)]
    for call in info.calls:
        is_read, path = _read_path(info, call, datasets)
        if not is_read or info.guarded(call):
            continue
        scope = info.function_of(call)
        for write, wpath in writes:
            if (info.function_of(write) is not scope or write.lineno >= call.lineno
                    or not _same_file(wpath, path)):
                continue
            if any(info.function_of(b) is scope and write.lineno < b.lineno < call.lineno
                   for b in barriers):
                continue
            yield (call, f"reads a file after rank 0 writes one at line {write.lineno}, with no "
                         f"dist.barrier() in between: the other ranks may read it before it "
                         f"is complete (or before it exists)", None)
            break


# -- DT007 --------------------------------------------------------------------------------
def _device_problem(info: ScriptInfo, expr: ast.AST, scope: str,
                    constants: bool = True) -> str | None:
    if constants and isinstance(expr, ast.Constant) and isinstance(expr.value, int) \
            and not isinstance(expr.value, bool):
        return (f"hard-codes GPU {expr.value}: every rank uses the same GPU (NCCL: Duplicate "
                f"GPU detected, or one card carries every process)")
    if info.rank_kind(expr, scope) == "global" and not info.single_node():
        return (f"`{src(expr)}` is the global rank (RANK, dist.get_rank(), what "
                f"init_process_group gets as rank): it is a valid GPU index only on a single "
                f"node; on the next node it exceeds the GPU count (CUDA error: invalid device "
                f"ordinal)")
    return None


# calls that take a device index as their first argument
_SET_DEVICE = ("torch.cuda.set_device", "torch.accelerator.set_device_index",
               "torch.accelerator.set_device_idx", "torch.accelerator.device_index",
               "torch.cuda.device", "torch.xpu.set_device")


@rule("DT007", "local-rank-device",
      "a device (DDP device_ids, set_device, torch.accelerator.*, .to/.cuda) not taken from "
      "LOCAL_RANK",
      "Use the local rank: `local_rank = int(os.environ['LOCAL_RANK'])`, "
      "`torch.cuda.set_device(local_rank)`, `DDP(model, device_ids=[local_rank])`.")
def dt007(info: ScriptInfo) -> Iterator[Hit]:
    moves: dict[int, list[tuple[ast.Call, str]]] = {}   # function -> .to(rank)/.cuda(rank)
    for call in info.method_calls("to", "cuda"):
        if call.args:
            problem = _device_problem(info, call.args[0], info.scope_of(call), constants=False)
            if problem:
                moves.setdefault(id(info.function_of(call)), []).append((call, problem))
    named: set[int] = set()

    def also(call: ast.Call) -> str:
        """The same function's .to(rank) lines, named with the device_ids/set_device hit."""
        func = id(info.function_of(call))
        lines = sorted({c.lineno for c, _ in moves.get(func, [])})
        named.add(func)
        where = ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))
        return f" (and .to/.cuda with it on {where})" if lines else ""

    for call in info.calls_to("DistributedDataParallel"):
        ids = keyword(call, "device_ids", 1)
        if isinstance(ids, (ast.List, ast.Tuple)):
            for elt in ids.elts:
                problem = _device_problem(info, elt, info.scope_of(call))
                if problem:
                    yield call, f"device_ids=[{src(elt)}] {problem}{also(call)}", None
    for call in info.calls_to(*_SET_DEVICE):
        if call.args:
            problem = _device_problem(info, call.args[0], info.scope_of(call))
            if problem:
                yield call, f"{src(call.func)}({src(call.args[0])}) {problem}{also(call)}", None
    for func, found in moves.items():   # one finding per function: the same mistake
        if func not in named:
            call, problem = found[0]
            rest = [str(c.lineno) for c, _ in found[1:]]
            more = f" (also line{'s' if len(rest) > 1 else ''} {', '.join(rest)})" if rest else ""
            yield call, f".{call.func.attr}({src(call.args[0])}) {problem}{more}", None  # type: ignore[attr-defined]


# -- DT008 --------------------------------------------------------------------------------
_LAUNCH = "torch.distributed.launch"


def _is_launch_module(name: str) -> bool:
    return name == _LAUNCH or name.startswith(_LAUNCH + ".")   # not torch.distributed.launcher


def _imports_launch(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(_is_launch_module(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return _is_launch_module(node.module) or (
            node.module == "torch.distributed" and any(a.name == "launch" for a in node.names))
    return False


@rule("DT008", "torch-distributed-launch",
      "torch.distributed.launch (deprecated) or its --local_rank argument",
      "Launch with torchrun (`torchrun --nproc-per-node N train.py`, or `disttrain run "
      "train.py`) and read `int(os.environ['LOCAL_RANK'])` instead of a --local_rank "
      "argument.")
def dt008(info: ScriptInfo) -> Iterator[Hit]:
    for node in info.nodes:
        if _imports_launch(node):
            yield node, "imports torch.distributed.launch, which is deprecated", None
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _LAUNCH in node.value and not info.is_docstring(node):
            yield (node, "starts workers with `python -m torch.distributed.launch`, which is "
                         "deprecated and passes --local-rank as an argument", None)
    reads_env = any(isinstance(n, ast.Constant) and n.value == "LOCAL_RANK"
                    for n in info.nodes)
    for call in info.method_calls("add_argument"):
        flags = [literal_str(a) for a in call.args]
        # a script that also reads LOCAL_RANK only keeps the flag for old launchers
        if any(f in ("--local_rank", "--local-rank") for f in flags) and not reads_env:
            yield (call, "takes --local_rank as an argument, the torch.distributed.launch "
                         "protocol: torchrun passes LOCAL_RANK in the environment instead", None)


# -- DT009 --------------------------------------------------------------------------------
@rule("DT009", "destroy-process-group",
      "init_process_group without destroy_process_group",
      "Call dist.destroy_process_group() when training ends (in a `finally:` so it also "
      "runs after an error); leaking the group can hang the exit and leaks NCCL resources.")
def dt009(info: ScriptInfo) -> Iterator[Hit]:
    inits = list(info.calls_to("init_process_group"))
    if inits and not any(True for _ in info.calls_to("destroy_process_group")):
        yield (inits[0], "init_process_group() is never paired with "
                         "destroy_process_group()", None)


# -- DT010 --------------------------------------------------------------------------------
@rule("DT010", "download-race",
      "dataset download on every rank (a race: download on rank 0, then barrier)",
      "Download on rank 0 only, then `dist.barrier()`, then build the dataset with "
      "download=False on every rank (or download once before launching the job).")
def dt010(info: ScriptInfo) -> Iterator[Hit]:
    if not info.is_distributed():
        return
    for call in info.calls:
        download = keyword(call, "download")
        is_download = isinstance(download, ast.Constant) and download.value is True
        name = info.call_name(call)
        if not is_download and not name.endswith(("urlretrieve", "wget.download")):
            continue
        if info.guarded(call) or info.in_unused_function(call):
            continue
        what = f"{src(call.func)}(download=True)" if is_download else f"{src(call.func)}()"
        yield (call, f"{what} runs on every rank: all ranks download and extract into the "
                     f"same directory at once, which can corrupt the files", None)
