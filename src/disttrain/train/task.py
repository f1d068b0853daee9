"""A TrainTask: the user's model, data, loss or step function and metrics, in one object.

    # mytask.py
    from disttrain import TrainTask

    def make_task(hidden: int = 128) -> TrainTask:
        return TrainTask(model=lambda: MyNet(hidden), train_data=MyDataset("/data/train"),
                         eval_data=MyDataset("/data/val"), loss_fn=nn.CrossEntropyLoss(),
                         metrics={"accuracy": accuracy})

    disttrain run --task mytask:make_task --task-args '{"hidden": 256}'   # or `task:` in job.yaml

The Trainer does the rest: sharding and shuffling, set_epoch, accumulation with one
all-reduce per optimizer step, AMP, comm hooks, FSDP, exact resume, metrics summed over
every rank's shard, the sync check, the run directory (docs/your-model.md). The task says
only what is the user's: what the model is, what a batch is, and what the loss of a batch is.

A task is resolved from a `module:function` reference by `load_task`, with the spec file's
folder and the current folder on `sys.path`, so a pod that runs the shipped module finds it
the same way a local run does.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.errors import SpecError
from disttrain.spec.fields import parse_task_reference

# name -> fn(outputs, batch) -> (sum, count): summed over every rank's shard, then divided
Metric = Callable[[Any, Any], "tuple[Any, Any]"]
StepFn = Callable[[Any, Any], Any]               # (model, batch) -> scalar loss tensor
OptimizerFactory = Callable[[Iterable[Any], float], Any]   # (params, lr) -> torch Optimizer


class TaskError(SpecError):
    """A task reference or a TrainTask that cannot be trained; the message names the fix."""


@dataclass(frozen=True)
class TrainTask:
    """What to train. Only `model` and `train_data` are required, plus one of `loss_fn`
    (for `(input, target)` batches) or `step_fn` (for anything else).

    Args:
        model: an `nn.Module`, or a factory returning one. A factory is called after every
            rank seeded its RNGs, so all ranks start from the same weights without a broadcast.
        train_data: a map-style `Dataset` (the Trainer shards it: every rank a disjoint slice,
            the order from the seed and the epoch) or an `IterableDataset` (sharded by rank and
            DataLoader worker by the dataset itself: see docs/your-model.md).
        eval_data: an optional held-out `Dataset`; each sample is counted once over all ranks.
        loss_fn: `loss_fn(model(input), target) -> scalar` for `(input, target)` batches.
        step_fn: `step_fn(model, batch) -> scalar loss` for any other batch structure; it may
            also return `(loss, outputs)` so that `metrics` see the outputs.
        metrics: name -> `fn(outputs, batch) -> (sum, count)`, reduced over ranks, then
            sum / count is written per epoch to metrics.jsonl and summary.json's `eval`.
        optimizer: `optimizer(params, lr) -> torch.optim.Optimizer`; default: the spec's
            optimizer (AdamW / SGD) at the spec's scaled learning rate.
        collate_fn: passed to the DataLoader for both splits.
        fsdp_block: the module class (or classes) FSDP wraps one unit per instance of (a
            transformer block); default: the model's direct children that hold parameters.
        name: how the run is called in banners and summary.json; default: the factory's name.
    """

    model: Any
    train_data: Any
    eval_data: Any = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    step_fn: StepFn | None = None
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    optimizer: OptimizerFactory | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    fsdp_block: type | tuple[type, ...] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        problems = task_problems(self)
        if problems:
            raise TaskError("TrainTask: " + "; ".join(problems))


def task_problems(task: TrainTask) -> list[str]:
    """What is wrong with a task's fields, checked without building the model or reading data
    (so it runs before any process starts)."""
    from torch import nn
    from torch.utils.data import Dataset, IterableDataset

    out: list[str] = []
    if not (isinstance(task.model, nn.Module) or callable(task.model)):
        out.append(f"model must be an nn.Module or a function returning one, got "
                   f"{type(task.model).__name__}")
    for name in ("train_data", "eval_data"):
        data = getattr(task, name)
        if data is None and name == "eval_data":
            continue
        if not isinstance(data, (Dataset, IterableDataset)) and not _is_sized_indexable(data):
            out.append(f"{name} must be a torch Dataset or IterableDataset, got {type(data).__name__}")
        elif not isinstance(data, IterableDataset) and _safe_len(data) == 0:
            verb = "train" if name == "train_data" else "evaluate"
            out.append(f"{name} has length 0: nothing to {verb} on")
    if task.loss_fn is None and task.step_fn is None:
        out.append("give loss_fn (for (input, target) batches) or step_fn(model, batch) -> loss")
    if task.loss_fn is not None and task.step_fn is not None:
        out.append("give loss_fn or step_fn, not both (step_fn computes the loss itself)")
    for label, fn in (("loss_fn", task.loss_fn), ("step_fn", task.step_fn), ("optimizer", task.optimizer),
                      ("collate_fn", task.collate_fn)):
        if fn is not None and not callable(fn):
            out.append(f"{label} must be callable, got {type(fn).__name__}")
    if not isinstance(task.metrics, Mapping):
        out.append(f"metrics must be a dict of name -> fn(outputs, batch) -> (sum, count), got "
                   f"{type(task.metrics).__name__}")
    else:
        for key, fn in task.metrics.items():
            if not isinstance(key, str) or not key.isidentifier() or key in ("loss", "split", "rank"):
                out.append(f"metric name {key!r} must be an identifier other than loss/split/rank")
            elif not callable(fn):
                out.append(f"metric {key!r} must be callable, got {type(fn).__name__}")
    blocks = task.fsdp_block if isinstance(task.fsdp_block, tuple) else (task.fsdp_block,)
    if task.fsdp_block is not None and not all(isinstance(b, type) and issubclass(b, nn.Module)
                                               for b in blocks):
        out.append("fsdp_block must be an nn.Module subclass (or a tuple of them)")
    return out


def _is_sized_indexable(data: Any) -> bool:
    return hasattr(data, "__len__") and hasattr(data, "__getitem__")


def _safe_len(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


# -- references: "module:function" ---------------------------------------------------------
def parse_reference(ref: str) -> tuple[str, str]:
    """'pkg.mod:make_task' -> ('pkg.mod', 'make_task'); a file path 'tasks/my.py:fn' too
    (the syntax check is the spec's, `disttrain.spec.fields.parse_task_reference`)."""
    try:
        return parse_task_reference(ref)
    except ValueError as exc:
        raise TaskError(f"task {ref!r}: {exc}") from None


def load_task(ref: str, args: Mapping[str, Any] | None = None,
              search: Sequence[str | Path] = ()) -> TrainTask:
    """Import `ref`, call it with `args`, and check what it returns.

    Args:
        ref: `module:function`; the module is looked up first in `search` (the spec file's
            folder, then the current folder), then on the normal `sys.path`.
        args: keyword arguments for the factory (the spec's `task_args`).
        search: folders put in front of `sys.path` for the import (kept there: the
            DataLoader's worker processes must import the same module).

    Raises:
        TaskError: the module or function is missing, the factory raised or returned
            something other than a TrainTask; the message says which and what was searched.
    """
    factory = check_task(ref, args, search)
    kwargs = dict(args or {})
    try:
        task = factory(**kwargs)
    except TaskError:
        raise
    except Exception as exc:
        tb = "".join(traceback.format_exception(exc)[-6:]).rstrip()
        raise TaskError(f"task {ref!r} raised {type(exc).__name__}: {exc}\n{tb}") from None
    if not isinstance(task, TrainTask):
        raise TaskError(f"task {ref!r} returned {type(task).__name__}, not a disttrain.TrainTask: "
                        f"return TrainTask(model=..., train_data=..., loss_fn=...)")
    if task.name is None:
        object.__setattr__(task, "name", getattr(factory, "__name__", ref))
    return task


def check_task(ref: str, args: Mapping[str, Any] | None = None,
               search: Sequence[str | Path] = ()) -> Callable[..., Any]:
    """The factory `ref` names, imported and checked against `args` but not called: what
    `disttrain run` does before any process starts, so a bad reference or a typo in
    `task_args` exits 2 with nothing written.

    Raises:
        TaskError: the module or function is missing, or `args` do not fit its signature.
    """
    factory = resolve_factory(ref, search)
    _check_signature(ref, factory, dict(args or {}))
    return factory


def resolve_factory(ref: str, search: Sequence[str | Path] = ()) -> Callable[..., Any]:
    """The function `ref` names, imported (no call); TaskError says what was searched."""
    module_name, attr = parse_reference(ref)
    folders = list(dict.fromkeys(str(Path(p).resolve()) for p in search))  # the same folder once
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.split(".")[0] != exc.name.split(".")[0]:
            raise TaskError(f"task {ref!r}: module {module_name!r} imports {exc.name!r}, which is not "
                            f"installed here") from None
        where = ", ".join(folders) or "the current folder"
        raise TaskError(f"task {ref!r}: no module {module_name!r} in {where} or on sys.path; put "
                        f"{module_name.replace('.', '/')}.py beside the spec file or pass its folder"
                        ) from None
    except SyntaxError as exc:
        raise TaskError(f"task {ref!r}: {exc.filename}:{exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        raise TaskError(f"task {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
                        ) from None
    factory = getattr(module, attr, None)
    if factory is None:
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise TaskError(f"task {ref!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has "
                        f"no {attr!r}; its functions: {', '.join(names[:12]) or 'none'}")
    if not callable(factory):
        raise TaskError(f"task {ref!r}: {attr!r} is a {type(factory).__name__}, not a function")
    return factory


def _check_signature(ref: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Unknown task_args are named before the factory runs (a typo must not be swallowed)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = sorted(set(kwargs) - set(sig.parameters))
    if unknown:
        raise TaskError(f"task_args: {ref} takes no argument(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(sig.parameters) or 'none'}")
    try:
        sig.bind(**kwargs)
    except TypeError as exc:
        raise TaskError(f"task_args for {ref}: {exc}") from None
