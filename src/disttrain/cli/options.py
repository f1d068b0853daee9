"""Click options generated from the JobSpec fields: one flag per field, same name.

A hand-kept flag list beside the spec drifts (torchtitan's frozen flags); generating the
flags from the pydantic fields keeps `--field-name` and the YAML key the same thing.
Only flags the user actually gave become overrides, so a spec file's values survive.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

import click
import yaml

from disttrain.errors import SpecError
from disttrain.spec.job import field_index

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


def spec_options(sections: Iterable[str | None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a `--field-name` option for each field of the given sections."""
    wanted = set(sections)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name, (section, info) in reversed(list(field_index().items())):
            if section not in wanted or name in HIDDEN:
                continue
            ptype, is_flag = _param_type(info.annotation)
            flag = "--" + name.replace("_", "-")
            help_text = info.description or ""
            if section:
                help_text = f"[{section}] {help_text}"
            if is_flag:
                decl = f"{flag}/--no-{name.replace('_', '-')}"
                fn = click.option(decl, name, default=None, help=help_text)(fn)
            else:
                fn = click.option(flag, name, type=ptype, default=None, help=help_text,
                                  show_default=False)(fn)
        return fn

    return decorate


def collect_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the spec flags out of a click kwargs dict; keep only those the user gave."""
    index = field_index()
    overrides = {}
    for name in list(kwargs):
        if name in index and name not in HIDDEN:
            value = kwargs.pop(name)
            if value is not None:
                overrides[name] = value
    return overrides


def job_overrides(script: str | None, script_args: tuple[str, ...],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """The spec flags plus SCRIPT and its arguments (a script replaces the built-in job)."""
    overrides = collect_overrides(kwargs)
    if script:
        overrides["script"] = script
        overrides["example"] = None
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
    """JobSpec from an optional file plus flag overrides; SpecError -> exit 2."""
    from disttrain.spec.job import JobSpec

    try:
        return JobSpec.from_yaml(spec_file, overrides)
    except SpecError as exc:
        fail(str(exc))
