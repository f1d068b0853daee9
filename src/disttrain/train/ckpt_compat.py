"""Does a checkpoint fit the model it is about to be loaded into? Said before torch says it.

`--resume` (or a torchrun restart) onto a run dir that holds another model's checkpoint
would end in torch's `Error(s) in loading state_dict for Net: ...`, raised from inside
disttrain's checkpoint code with the traceback of its frames, which reads like a disttrain
bug. The keys and shapes are compared first instead, and the difference is named (a few
keys of each kind) with the fix: another run dir, or no `--resume`.

    problem = state_dict_mismatch(model.state_dict(), ckpt["model"])
    # "2 keys missing from the checkpoint (fc2.weight, fc2.bias); 1 of another shape
    #  (fc1.weight: checkpoint [16, 64], model [32, 64])"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHOWN = 3   # keys named per kind of difference


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _few(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    return shown + (f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")


def state_dict_mismatch(model: Mapping[str, Any], saved: Any) -> str | None:
    """How the checkpoint's model state differs from this model's, or None when every key
    is there with the same shape."""
    if not isinstance(saved, Mapping):
        return f"its model entry is a {type(saved).__name__}, not a state dict"
    missing = [k for k in model if k not in saved]
    unexpected = [str(k) for k in saved if k not in model]
    shapes = [f"{k}: checkpoint {list(_shape(saved[k]) or [])}, model {list(_shape(v) or [])}"
              for k, v in model.items()
              if k in saved and _shape(v) is not None and _shape(saved[k]) != _shape(v)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of this model missing from it ({_few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) this model does not have ({_few(unexpected)})")
    if shapes:
        parts.append(f"{len(shapes)} of another shape ({_few(shapes)})")
    return "; ".join(parts) or None


def resume_fix(run_dir_hint: str) -> str:
    """The fix for a checkpoint of another model, naming where it was found."""
    return (f"it was saved by another model: train this one into another run dir "
            f"(--run-dir, or --name) or start without --resume; delete {run_dir_hint} only "
            f"if that run is no longer needed")
