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

A task is built from a reference by `load_task` (the one entry: reference + task_args ->
TrainTask), with the spec file's folder and the current folder on `sys.path`, so a pod that
runs the shipped module finds it the same way a local run does. A reference is
`module:function` or `path/to/file.py:function` (the file's folder goes first on the path,
as `python path/to/file.py` would do). `task_args` are validated against the function's
signature and annotations by pydantic (`validate_call`) before anything runs, so
`{"n": "lots"}` for `n: int` is one line naming `n`. The built-in jobs are tasks too
(`disttrain.examples.digits:make_task`, ...); `task_hooks` lets a factory add a check
that runs before launch and data that the warm fork server loads once for all workers.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import traceback
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.errors import FailureKind, SpecError
from disttrain.spec.fields import parse_task_reference, task_file

# name -> fn(outputs, batch) -> (sum, count): summed over every rank's shard, then divided
Metric = Callable[[Any, Any], "tuple[Any, Any]"]
StepFn = Callable[[Any, Any], Any]               # (model, batch) -> scalar loss tensor
OptimizerFactory = Callable[[Iterable[Any], float], Any]   # (params, lr) -> torch Optimizer


class TaskError(SpecError):
    """A task reference or a TrainTask that cannot be trained; the message names the fix."""

    kind = FailureKind.TASK   # a rank that raises it: `disttrain run` says it once, exits 2


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
        load_weights: for a model factory that builds on the meta device (a pretrained model
            read from disk once, `disttrain.recipes`): `load_weights(model, rt, strategy,
            wrap) -> model` gives the parameters their values and calls `wrap(model)` where
            it must (before the values for FSDP2, after them for DDP; `wrap(model, **kw)`
            passes DDP keyword arguments: the recipe's `init_sync=False`); default: the
            factory's own values, then `wrap(model)`.
        on_end: `on_end(model, rt, output_dir, eval) -> dict`, called on every rank after
            training ended (not when it was stopped to resume later), after the sync check:
            the task saves what lasts (the recipe: the model in Hugging Face format to
            `train.output_dir`, None when unset) and returns entries for summary.json.
        save_frozen: False when the model's frozen parameters come back identical from the
            task's own loading (a LoRA base read again from its model directory): the run's
            checkpoints then hold the trainable parameters only (train/ckpt_trainable.py).
        example_batch: `example_batch(batch_size) -> batch`, one batch of a rank's shape
            (the structure, shapes and dtypes the loader would give for that per-rank batch
            size; the values do not matter). `disttrain plan` traces it instead of reading
            `train_data`, for data the planning machine cannot read (a cluster volume, a
            download); default: the plan reads one batch through the task's own loader.
            The run never calls it.
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
    load_weights: Callable[..., Any] | None = None
    on_end: Callable[..., Mapping[str, Any]] | None = None
    # tensor parallel (issue 26): {"module.path.*": ParallelStyle} or fn(model, tp_mesh) -> None;
    # None = a built-in plan matched by module names (disttrain.distributed.tensor_parallel)
    tp_plan: Any = None
    save_frozen: bool = True
    example_batch: Callable[[int], Any] | None = None

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
                      ("collate_fn", task.collate_fn), ("load_weights", task.load_weights),
                      ("on_end", task.on_end), ("example_batch", task.example_batch)):
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


# -- references: "module:function" or "path/file.py:function" ------------------------------
def parse_reference(ref: str) -> tuple[str, str]:
    """'pkg.mod:make_task' -> ('pkg.mod', 'make_task'); a file 'tasks/my.py:fn' -> ('my', 'fn')
    (the syntax check is the spec's, `disttrain.spec.fields.parse_task_reference`)."""
    try:
        return parse_task_reference(ref)
    except ValueError as exc:
        raise TaskError(f"task {ref!r}: {exc}") from None


def load_task(ref: str, args: Mapping[str, Any] | None = None,
              search: Sequence[str | Path] = ()) -> TrainTask:
    """Build the TrainTask `ref` names: import it, validate `args`, call it, check the result.
    The one way from a reference to a task: workers, `disttrain.fit` users and planners
    call this.

    Args:
        ref: `module:function` or `file.py:function`; a module is looked up first in
            `search` (the spec file's folder, then the current folder), then on the normal
            `sys.path`; a relative file is found in `search`.
        args: keyword arguments for the factory (the spec's `task_args`), validated against
            its signature and annotations (`validate_task_args`).
        search: folders put in front of `sys.path` for the import (kept there: the
            DataLoader's worker processes must import the same module).

    Raises:
        TaskError: the module or function is missing, `args` do not fit its signature, the
            factory raised or returned something other than a TrainTask; the message says
            which and what was searched.
    """
    factory = resolve_factory(ref, search)
    kwargs = validate_task_args(ref, factory, args)
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
    """The factory `ref` names, imported, `args` validated, its `task_hooks` check run, but
    not called: what `disttrain run` does before any process starts, so a bad reference, a
    typo or a wrong type in `task_args`, or data that is not there exits 2 with nothing
    written.

    Raises:
        TaskError: the module or function is missing, `args` do not fit its signature, or
            the factory's check refused them.
    """
    factory = resolve_factory(ref, search)
    kwargs = validate_task_args(ref, factory, args)
    hooks = hooks_of(factory)
    if hooks.check is not None:
        hooks.check(**kwargs)
    return factory


def resolve_factory(ref: str, search: Sequence[str | Path] = ()) -> Callable[..., Any]:
    """The function `ref` names, imported (no call); TaskError says what was searched."""
    module_name, attr = parse_reference(ref)
    folders = list(dict.fromkeys(str(Path(p).resolve()) for p in search))  # the same folder once
    path = task_file(ref)
    if path is not None:
        found = _find_file(Path(path), folders)
        if found is None:
            where = ", ".join(folders) or "the current folder"
            raise TaskError(f"task {ref!r}: no file {path} (looked in {where}); give the path of "
                            f"an existing .py file")
        folders = [str(found.parent), *folders]  # the file's folder first, as `python FILE` does
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if path is not None and sys.path[0] != folders[0]:  # the file's own folder wins
        sys.path.insert(0, folders[0])
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
    if path is not None and not _same_file(getattr(module, "__file__", None), found):
        raise TaskError(f"task {ref!r}: the module name {module_name!r} is taken by "
                        f"{getattr(module, '__file__', None) or 'a built-in module'}; rename {found.name}")
    factory = getattr(module, attr, None)
    if factory is None:
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise TaskError(f"task {ref!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has "
                        f"no {attr!r}; its functions: {', '.join(names[:12]) or 'none'}")
    if not callable(factory):
        raise TaskError(f"task {ref!r}: {attr!r} is a {type(factory).__name__}, not a function")
    return factory


def _find_file(path: Path, folders: Sequence[str]) -> Path | None:
    """A task file: absolute as given, else relative to the first search folder that has it."""
    candidates = [path] if path.is_absolute() else [Path(f) / path for f in folders or ["."]]
    return next((c.resolve() for c in candidates if c.is_file()), None)


def _same_file(module_file: str | None, path: Path) -> bool:
    return module_file is not None and Path(module_file).resolve() == path


def task_parameters(ref: str, factory: Callable[..., Any]) -> list[str] | None:
    """The keyword arguments `factory` takes, or None when it takes any (`**kwargs`) or its
    signature cannot be read."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def validate_task_args(ref: str, factory: Callable[..., Any],
                       args: Mapping[str, Any] | None) -> dict[str, Any]:
    """`args` checked against the factory's signature and annotations with pydantic's
    `validate_call` (the factory is not called), as the values the factory will get
    (`"3"` for `n: int` becomes 3; `"lots"` is refused).

    Raises:
        TaskError: an unknown argument name, a missing required one, or a value that does not
            fit its annotation; one line per argument, naming it and what it takes.
    """
    from pydantic import ConfigDict, ValidationError, validate_call

    kwargs = dict(args or {})
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check against
        return kwargs
    try:
        hints = typing.get_type_hints(factory, include_extras=True)
    except Exception:  # an annotation that does not resolve here: check the names only
        hints = {}
    params = [p.replace(annotation=hints.get(p.name, Any)) for p in sig.parameters.values()]

    def bound(*_: Any, **given: Any) -> dict[str, Any]:
        return given

    bound.__signature__ = sig.replace(parameters=params, return_annotation=Any)  # type: ignore[attr-defined]
    bound.__annotations__ = {p.name: p.annotation for p in params}
    try:
        checker = validate_call(bound, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # pydantic cannot build a schema for some annotation: names only
        bound.__signature__ = sig.replace(parameters=[p.replace(annotation=Any) for p in params])  # type: ignore[attr-defined]
        bound.__annotations__ = {p.name: Any for p in params}
        checker = validate_call(bound)
    try:
        checked = checker(**kwargs)
    except ValidationError as exc:
        raise TaskError(_format_args_error(ref, factory, exc)) from None
    return {k: checked.get(k, v) for k, v in kwargs.items()}


def _format_args_error(ref: str, factory: Callable[..., Any], exc: Any) -> str:
    takes = task_parameters(ref, factory)
    lines = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "(all)"
        if err["type"] == "unexpected_keyword_argument":
            lines.append(f"task_args: {ref} takes no argument {name}; it takes "
                         f"{', '.join(takes or []) or 'none'}")
        elif err["type"].startswith("missing"):
            lines.append(f"task_args: {ref} needs the argument {name}")
        else:
            given = json.dumps(err.get("input"), default=repr)
            lines.append(f"task_args: {name}: {err['msg']} (got {given}; {ref})")
    return "\n".join(lines)


# -- hooks: a check before launch, data loaded once in the warm fork server ----------------------
@dataclass(frozen=True)
class TaskHooks:
    """Optional extras of a task factory (`task_hooks`); both take the validated task_args."""

    check: Callable[..., None] | None = None
    warm: Callable[..., bool] | None = None


_HOOKS = "__disttrain_task_hooks__"
_NO_HOOKS = TaskHooks()
_warmed: set[str] = set()   # the references + args warmed in this process (or its fork parent)


def task_hooks(*, check: Callable[..., None] | None = None,
               warm: Callable[..., bool] | None = None) -> Callable[[Any], Any]:
    """Decorate a task factory with a pre-launch check and a data warm-up.

    Args:
        check: `check(**task_args)` raises TaskError naming the fix (e.g. data files that are
            not there); `disttrain run` calls it before any process starts or anything is
            written. It must be quick and must not import the task's data.
        warm: `warm(**task_args) -> bool` loads the task's data into a cache of this process
            (never downloading) that the factory then reads; the warm fork server calls it
            once before it forks the local workers, so they share one copy
            (`disttrain.launch.forkserver_preload`). Returns whether it loaded.
    """
    def mark(factory: Any) -> Any:
        setattr(factory, _HOOKS, TaskHooks(check, warm))
        return factory

    return mark


def hooks_of(factory: Any) -> TaskHooks:
    return getattr(factory, _HOOKS, _NO_HOOKS)


def _warm_key(ref: str, args: Mapping[str, Any] | None) -> str:
    return json.dumps([ref, dict(args or {})], sort_keys=True, default=repr)


def warm_task(ref: str, args: Mapping[str, Any] | None = None,
              search: Sequence[str | Path] = ()) -> bool:
    """Run the `warm` hook of the factory `ref` names (the warm fork server's part); False
    when it has none, or anything fails (the workers then load their own data and report)."""
    try:
        factory = resolve_factory(ref, search)
        warm = hooks_of(factory).warm
        if warm is None or not warm(**validate_task_args(ref, factory, args)):
            return False
    except Exception:  # a worker builds the task again and reports the cause
        return False
    _warmed.add(_warm_key(ref, args))
    return True


def task_warmed(ref: str | None, args: Mapping[str, Any] | None = None) -> bool:
    """Whether this process's data for `ref` with `args` came from the warm fork server."""
    return ref is not None and _warm_key(ref, args) in _warmed
