"""The building blocks every spec section shares: the strict base model, the name and
quantity grammars, and the choice lists.

    class LaunchSpec(StrictModel): ...          # unknown keys, inf/NaN and NUL refused
    is_dns1123_label("mnist-ddp")              # True
    parse_quantity("8Gi")                       # Decimal(8589934592)
    EXAMPLES                                    # ('digits', 'mnist', ..., 'chargpt')
    example_task("chargpt")                     # 'disttrain.examples.chargpt:make_task'

A choice list is written once, as the `Literal` a field is typed with; code that needs the
names as a tuple (the comm hook registry, the HAMi preset and workaround tables) takes them from
`typing.get_args` of that Literal, so a new choice cannot reach the spec without reaching
the code, or the other way round. Pydantic only: no disttrain imports.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import PurePath
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, field_validator

__all__ = [
    "COMM_HOOKS", "DEFAULT_TASK", "EXAMPLES", "NCCL_PRESET_NAMES", "VGPU_WORKAROUNDS", "CommHook",
    "Example", "NcclPreset", "StrictModel", "VgpuWorkaround", "check_quantity", "dns_label",
    "example_task", "is_dns1123_label", "is_dns1123_subdomain", "parse_quantity",
    "parse_task_reference", "task_file", "task_job_name",
]

# -- choice lists ----------------------------------------------------------------------------
Example = Literal["digits", "mnist", "synthetic", "seed002", "chargpt"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
VgpuWorkaround = Literal["no-p2p", "no-shm", "no-cumem-host", "no-vgpu-control"]
NcclPreset = Literal["default", "debug", "no-ib", "no-p2p", "ib"]
EXAMPLES: tuple[str, ...] = get_args(Example)
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
VGPU_WORKAROUNDS: tuple[str, ...] = get_args(VgpuWorkaround)
NCCL_PRESET_NAMES: tuple[str, ...] = get_args(NcclPreset)

# -- names -----------------------------------------------------------------------------------
# Kubernetes object names (RFC 1123). fullmatch, not `$`: `$` also matches before a
# trailing newline, which would let "job\n" through to a run dir or a manifest.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_dns1123_label(text: str) -> bool:
    """A DNS-1123 label: at most 63 lower-case letters, digits or '-', alphanumeric ends."""
    return len(text) <= 63 and _DNS1123_LABEL.fullmatch(text) is not None


def is_dns1123_subdomain(text: str) -> bool:
    """Dot-separated DNS-1123 labels, at most 253 characters (PVC and Secret names)."""
    return len(text) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(text) is not None


# -- task references ---------------------------------------------------------------------------
# The built-in jobs are tasks like any user's (docs/your-model.md): `--example NAME` and an old
# spec's `example: NAME` are short for this reference, and a job with neither a script nor a
# task trains the first one.
EXAMPLE_TASK = "disttrain.examples.{}:make_task"
DEFAULT_TASK = EXAMPLE_TASK.format("digits")


def example_task(name: str) -> str:
    """The task reference a built-in job's short name stands for: 'chargpt' ->
    'disttrain.examples.chargpt:make_task'."""
    return EXAMPLE_TASK.format(name)


def task_file(ref: str) -> str | None:
    """The file a reference names ('../x/mytask.py:fn' -> '../x/mytask.py'), None for a
    module reference ('pkg.mod:fn')."""
    module = ref.rpartition(":")[0]
    return module if module.endswith(".py") else None


def parse_task_reference(ref: str) -> tuple[str, str]:
    """'pkg.mod:make_task' -> ('pkg.mod', 'make_task'); a file 'tasks/my.py:fn' ->
    ('my', 'fn'): a file is imported by its stem with its folder first on the path, as
    `python tasks/my.py` would (absolute and ../ paths too).

    The syntax alone (nothing is imported), so the spec can check a `task:` without torch;
    `disttrain.train.task` imports the module.

    Raises:
        ValueError: not `module:function`, or the module part is not an importable name.
    """
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr.isidentifier():
        raise ValueError("write it as module:function (e.g. mytask:make_task)")
    if module.endswith(".py"):
        stem = PurePath(module.replace("\\", "/")).stem
        if not stem.isidentifier():
            raise ValueError(f"{PurePath(module).name!r}: a task file's name must be an importable "
                             f"module name (letters, digits, '_'; e.g. my_task.py)")
        return stem, attr
    if not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"{module!r} is not an importable module name")
    return module, attr


def task_job_name(ref: str) -> str:
    """The job name a task reference gives a run when none is set (DNS-1123, as a script's
    stem does): 'disttrain.examples.chargpt:make_task' -> 'chargpt', 'mytask:build_small' ->
    'mytask-build-small', '/abs/x/my_task.py:make_task' -> 'my-task'."""
    module, attr = parse_task_reference(ref)
    words = module.rpartition(".")[2] + ("" if attr == "make_task" else f"-{attr}")
    return dns_label(words, fallback="task")


def dns_label(text: str, fallback: str) -> str:
    """A DNS-1123 label from any text: `multigpu_torchrun` -> `multigpu-torchrun`."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63].rstrip("-")
    return name or fallback


# -- Kubernetes quantities -------------------------------------------------------------------
# ASCII digits only ([0-9], not \d, which also takes other scripts' digits).
_QUANTITY = re.compile(r"\+?([0-9]+(?:\.[0-9]+)?)(?:[eE]([-+]?[0-9]+)|(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei))?")
_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "Pi": 2**50, "Ei": 2**60,
}


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity's value: '8Gi' -> 8 * 2**30, '500m' -> 0.5, '1e3' -> 1000.

    Raises:
        ValueError: `text` is not a quantity (the message gives examples).
    """
    m = _QUANTITY.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
    if m.group(2) is not None:
        return Decimal(m.group(1)) * Decimal(10) ** int(m.group(2))
    return Decimal(m.group(1)) * _SUFFIX[m.group(3) or ""]


def check_quantity(value: str | None, what: str) -> str | None:
    """`value` as a string when it is a quantity (None stays None); `what` names it."""
    if value is not None and not _QUANTITY.fullmatch(str(value)):
        raise ValueError(f"{what} {value!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
    return None if value is None else str(value)


# -- the strict base -------------------------------------------------------------------------
def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, (list, tuple)):
        return any(_has_nul(x) for x in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


class StrictModel(BaseModel):
    """The base of every spec section.

    Unknown fields are errors: a typo must never be silently ignored. Numbers must be
    finite and text (in lists and mappings too) free of NUL characters: both pass a type
    check and crash far later (int(inf) in the launcher; an embedded null byte in a path,
    an argv or a container's environment, which the API server or exec refuses).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, v: Any) -> Any:
        if _has_nul(v):
            raise ValueError("must not contain a NUL character")
        return v
