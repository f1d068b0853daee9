"""Click options generated from the JobSpec fields: one flag per field, same name.

A hand-kept flag list beside the spec drifts (torchtitan's frozen flags); generating the
flags from the pydantic fields keeps `--field-name` and the YAML key the same thing.
Only flags the user actually gave become overrides, so a spec file's values survive.

Two short forms are not fields: `--example NAME` is `--task disttrain.examples.NAME:make_task`,
and the built-in tasks' options (`--data-dir`, `--download`, `--num-samples`, `--input-size`,
`--hidden-size`) are entries of `task_args`, given to the task only when its function takes
them; a task that does not is refused naming the flag and what the task takes.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

import click
import yaml

from disttrain.errors import SpecError
from disttrain.spec.fields import EXAMPLES, example_task
from disttrain.spec.job import field_index
from disttrain.spec.paths import locate_task_file

# fields set by the CLI itself, never by a flag
HIDDEN = {"port_explicit", "script", "args", "task_dir"}

# every verb answers -h as well as --help
CTX: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


class YamlValue(click.ParamType):
    """A structured field given on the command line as YAML: --cpu '{request: "2"}'."""

    name = "yaml"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as exc:
            self.fail(f"not valid YAML: {exc}", param, ctx)
        except (ValueError, RecursionError) as exc:  # a date like 2024-02-30, deep nesting
            self.fail(f"not a usable YAML value ({type(exc).__name__}: {str(exc)[:200]})",
                      param, ctx)


class SpecFile(click.Path):
    """`-f FILE`: click.Path, with a NUL in the name reported as bad input (click's own
    os.stat raises ValueError on it, which would surface as a traceback)."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\x00" in value:
            self.fail("a file name cannot contain a NUL character", param, ctx)
        return super().convert(value, param, ctx)


class IntOrAuto(click.ParamType):
    name = "int|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer or 'auto'", param, ctx)


class IntOrText(click.ParamType):
    name = "int|text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return int(value)
        except (TypeError, ValueError):
            return value


def _strip_optional(ann: Any) -> Any:
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    return ann


def _param_type(ann: Any) -> tuple[Any, bool]:
    """(click type, is_flag) for a field annotation."""
    ann = _strip_optional(ann)
    if ann is bool:
        return bool, True
    if ann in (int, float, str):
        return ann, False
    if typing.get_origin(ann) is Literal:
        return click.Choice([str(a) for a in typing.get_args(ann)]), False
    args = set(typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        literal_auto = [a for a in args if typing.get_origin(a) is Literal]
        if int in args and literal_auto:
            return IntOrAuto(), False
        if args == {int, str}:
            return IntOrText(), False
    return YamlValue(), False


# The built-in tasks' options as flags: task_args entries, for the tasks whose functions take
# them (disttrain.examples.*: mnist takes data_dir and download; synthetic num_samples,
# input_size, hidden_size; ...). name -> (click type, help).
TASK_ARG_FLAGS: dict[str, tuple[Any, str]] = {
    "data_dir": (str, "dataset folder (task_args.data_dir; --example mnist: the IDX files)"),
    "download": (bool, "allow downloading a missing dataset (task_args.download; mnist)"),
    "num_samples": (click.IntRange(min=8), "dataset size (task_args.num_samples; synthetic, "
                                         "seed002)"),
    "input_size": (click.IntRange(min=1), "model input size (task_args.input_size; synthetic, "
                                        "seed002)"),
    "hidden_size": (click.IntRange(min=1), "SimpleNet hidden width (task_args.hidden_size; "
                                         "digits, mnist, synthetic)"),
}
# where the collected flags travel from `collect_overrides` to `load_spec` (not a field)
FLAG_TASK_ARGS = "task_args from flags"


def spec_options(sections: Iterable[str | None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a `--field-name` option for each field of the given sections (with
    `train`: the task-argument flags too; with the top level: `--example`)."""
    wanted = set(sections)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if "train" in wanted:
            for name, (ptype, help_text) in reversed(TASK_ARG_FLAGS.items()):
                if ptype is bool:
                    fn = click.option(f"{flag_name(name)}/--no-{name.replace('_', '-')}", name,
                                      default=None, help=help_text)(fn)
                else:
                    fn = click.option(flag_name(name), name, type=ptype, default=None,
                                      help=help_text)(fn)
        for name, (section, info) in reversed(list(field_index().items())):
            if BUILTIN_SECTIONS.get(section, section) not in wanted or name in HIDDEN:
                continue
            ptype, is_flag = _param_type(info.annotation)
            flag = flag_name(name)
            help_text = info.description or ""
            if section:
                help_text = f"[{section}] {help_text}"
            if is_flag:
                decl = f"{flag}/--no-{name.replace('_', '-')}"
                fn = click.option(decl, name, default=None, help=help_text)(fn)
            else:
                fn = click.option(flag, name, type=ptype, default=None, help=help_text,
                                  show_default=False)(fn)
        if None in wanted:
            fn = click.option("--example", "example", type=click.Choice(EXAMPLES), default=None,
                              help="a built-in job: short for --task "
                                   "disttrain.examples.NAME:make_task (default: digits)")(fn)
        return fn

    return decorate


# [train] fields a user script uses too: where its logs go, and its threads per rank
SCRIPT_TRAIN_FIELDS = ("run_dir", "threads")
# spec sections only the built-in job reads, flagged and listed with `train`
BUILTIN_SECTIONS = {"parallelism": "train"}
# top-level fields that choose the built-in job (a script replaces it)
BUILTIN_JOB_FIELDS = ("task", "task_args")

# the --help sections of a job verb, in order: the heading, and what it says about a script
SECTIONS = {
    "options": "Options",
    "launch": "Launch options (SCRIPT and the built-in job)",
    "cluster": "Cluster options (SCRIPT and the built-in job)",
    "train": "Built-in job options (not read by a SCRIPT: its own arguments go after --)",
}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _section_of(param: click.Parameter) -> str:
    """Which --help section an option belongs in (see SECTIONS)."""
    index = field_index()
    name = param.name or ""
    if name == "example" or name in TASK_ARG_FLAGS:
        return "train"
    if name not in index or name in HIDDEN:
        return "options"
    section = index[name][0]
    if name in SCRIPT_TRAIN_FIELDS or (section is None and name not in BUILTIN_JOB_FIELDS):
        return "launch"
    return "train" if section is None else BUILTIN_SECTIONS.get(section, section)


class SpecCommand(click.Command):
    """A job verb (`run`, `k8s render` ...): --help in sections, so that a script's user
    sees which flags are theirs (launch, cluster) and which only the built-in job reads
    (train; refused with a SCRIPT by `load_spec`); and an unknown option after SCRIPT is
    said to belong after `--` instead of being matched to a similar disttrain flag."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):  # in the usage line already
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(_section_of(param), []).append(record)
        for key, title in SECTIONS.items():
            if groups.get(key):
                with formatter.section(title):
                    formatter.write_dl(groups[key])

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # click's parser consumes `args`
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            before = given[:given.index("--")] if "--" in given else given
            script = next((a for a in before if a.endswith(".py")), None)
            if script is not None:  # the script's own flag, given without `--` before it
                exc.possibilities = None
                exc.message = (f"no such option: {exc.option_name}; put the script's own "
                               f"arguments after --: {script} [disttrain flags] -- "
                               f"{exc.option_name} ...")
            raise


def refuse_builtin_flags(script: str | None, overrides: dict[str, Any],
                         flag_args: dict[str, Any] | None = None) -> None:
    """A SCRIPT with flags only the built-in job reads: refused (SpecError), since the
    script never sees them (its own arguments go after `--`)."""
    index = field_index()
    given = [n for n in overrides if n in index and index[n][0] in ("train", *BUILTIN_SECTIONS)
             and n not in SCRIPT_TRAIN_FIELDS] + list(flag_args or {})
    if script and given:
        flags = ", ".join(flag_name(n) for n in given)
        raise SpecError(
            f"{flags}: built-in job flags (the built-in job and --task only), not read by a "
            f"script; pass the script's own arguments after --: {script} -- "
            f"{flag_name(given[0])} ...")


def collect_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the spec flags out of a click kwargs dict; keep only those the user gave."""
    index = field_index()
    overrides: dict[str, Any] = {}
    for name in list(kwargs):
        if name in index and name not in HIDDEN:
            value = kwargs.pop(name)
            if value is not None:
                overrides[name] = value
    example = kwargs.pop("example", None)
    if example is not None:
        if "task" in overrides:
            fail(f"--example: give --example {example} or --task {overrides['task']}, not both "
                 f"(--example {example} is --task {example_task(example)})")
        overrides["task"] = example_task(example)
    flag_args = {n: kwargs.pop(n) for n in TASK_ARG_FLAGS if n in kwargs}
    flag_args = {n: v for n, v in flag_args.items() if v is not None}
    if flag_args:
        overrides[FLAG_TASK_ARGS] = flag_args
    return overrides


def job_overrides(script: str | None, script_args: tuple[str, ...],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """The spec flags plus SCRIPT and its arguments (a script replaces the built-in job)."""
    overrides = collect_overrides(kwargs)
    if script:
        overrides["script"] = script
    if script_args:
        overrides["args"] = list(script_args)
    return overrides


def fail(message: str) -> typing.NoReturn:
    """Bad input: one clear message, exit 2, no traceback."""
    raise click.exceptions.Exit(_print_error(message))


def _print_error(message: str) -> int:
    click.echo(f"error: {message}", err=True)
    return 2


def load_spec(spec_file: str | None, overrides: dict[str, Any]):
    """JobSpec from an optional file plus flag overrides; SpecError -> exit 2.

    A task's module is looked for in the spec file's folder (a `task_dir` the file gives is
    relative to it), else the current folder; a task file (`../x/mytask.py:fn`) is found
    there too and becomes `mytask:fn` with its folder as `task_dir`, so that the workers and
    the pods (k8s/code.py ships from task_dir) import it the same way. Task-argument flags
    join `task_args` when the task's function takes them."""
    from disttrain.spec.job import JobSpec

    overrides = dict(overrides)
    flag_args = overrides.pop(FLAG_TASK_ARGS, {})
    try:
        spec = JobSpec.from_yaml(spec_file, overrides)
        refuse_builtin_flags(spec.script, overrides, flag_args)
        if spec.task:
            _locate_task(spec, spec_file)
        if flag_args:
            _add_flag_args(spec, flag_args, overrides.get("task_args") or {})
        return spec
    except SpecError as exc:
        fail(str(exc))


def _locate_task(spec: Any, spec_file: str | None) -> None:
    """Set the spec's task_dir (absolute) and turn a task file into module + folder."""
    from pathlib import Path

    base = Path(spec_file).resolve().parent if spec_file else Path.cwd()
    folder = (base / spec.task_dir).resolve() if spec.task_dir else base
    spec.task_dir = str(folder)
    located = locate_task_file(spec.task, folder)
    if located is not None:
        spec.task, spec.task_dir = located[0], str(located[1])


def _add_flag_args(spec: Any, flag_args: dict[str, Any], given_args: dict[str, Any]) -> None:
    """Put the task-argument flags into task_args, refusing one the task does not take."""
    from disttrain.train.task import resolve_factory, task_parameters

    twice = sorted(set(flag_args) & set(given_args))
    if twice:
        raise SpecError(f"{flag_name(twice[0])}: also given in --task-args; give it once")
    takes = task_parameters(spec.task, resolve_factory(spec.task, [spec.task_dir]))
    for name in flag_args:
        if takes is not None and name not in takes:
            raise SpecError(f"{flag_name(name)}: the task {spec.task} takes no {name} (its "
                            f"arguments: {', '.join(takes) or 'none'}); drop the flag, or use a "
                            f"task that takes it")
    spec.task_args = {**spec.task_args, **flag_args}
