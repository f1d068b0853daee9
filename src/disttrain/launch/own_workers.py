"""Does a user script start its own workers (mp.spawn, multiprocessing.Process)?

    own_workers("train.py")     # [OwnWorkers(line=42, call="mp.spawn")], [] when none

Why: a script written for `python train.py` that calls `mp.spawn(main, nprocs=N)` starts
N ranks itself. Under `disttrain run` (torchrun) with 2 processes per node, each of the 2
copies starts its own N, and the 2 x N processes fight over the script's hard-coded port
and hang with no output (pytorch/examples' `ddp/main.py` style). `disttrain run` refuses
that before anything starts and says how to run it (docs/your-model.md).

Read from the script's syntax tree (`disttrain.pysource`, as lint reads it), with its
import aliases resolved: calls of
`torch.multiprocessing.spawn` / `start_processes` and `multiprocessing.Process(target=...)`
(also through `torch.multiprocessing`, which re-exports it). A call under an `if` that
tests the launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE) is the script choosing
between torchrun and its own spawn, and is not reported. Pure: no import of the script.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from disttrain.pysource import dotted_name, import_aliases, parse_file

# module paths whose attribute calls start workers, after aliases are resolved
_SPAWNERS = {"torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
             "torch.multiprocessing.spawn.spawn", "torch.multiprocessing.spawn.start_processes"}
_PROCESS = {"multiprocessing.Process", "torch.multiprocessing.Process",
            "multiprocessing.context.Process"}
# names in an `if` test that mean the script asks whether a launcher started it
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "TORCHELASTIC")


@dataclass(frozen=True)
class OwnWorkers:
    """One place where the script starts worker processes itself."""

    line: int
    call: str  # as written in the script, e.g. `mp.spawn`


def own_workers(script: str | Path) -> list[OwnWorkers]:
    """Where `script` starts its own worker processes; [] when it does not (or when it
    cannot be parsed: python reports that itself when it runs)."""
    try:
        tree = parse_file(script)
    except (OSError, SyntaxError, ValueError):   # UnicodeDecodeError is a ValueError
        return []
    aliases = import_aliases(ast.walk(tree))
    found: list[OwnWorkers] = []
    _visit(tree, aliases, guarded=False, found=found)
    return found


def _tests_launcher(test: ast.AST) -> bool:
    for node in ast.walk(test):
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            else node.id if isinstance(node, ast.Name) else None
        if text and any(v in text.upper() for v in _LAUNCHER_VARS):
            return True
    return False


def _visit(node: ast.AST, aliases: dict[str, str], guarded: bool,
           found: list[OwnWorkers]) -> None:
    if isinstance(node, ast.If | ast.IfExp) and _tests_launcher(node.test):
        guarded = True
    if isinstance(node, ast.Call) and not guarded:
        path = dotted_name(node.func, aliases)
        starts = path in _SPAWNERS or (
            path in _PROCESS and any(k.arg == "target" for k in node.keywords))
        if starts:
            found.append(OwnWorkers(node.lineno, ast.unparse(node.func)))
    for child in ast.iter_child_nodes(node):
        _visit(child, aliases, guarded, found)
