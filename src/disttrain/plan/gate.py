"""The slice check `disttrain k8s render` and `apply` make before anything is rendered.

    verdict = check_slice(spec, plan=True)    # may set spec.cluster.gpumem (auto)
    verdict.notes     # ["gpumem 2304 MiB per GPU, planned: ..."] for stderr / a YAML comment
    verdict.refusal   # None, or the one line to exit 2 with (nothing is rendered)

- `gpumem: auto`: the plan's request goes into the Pod / Job / PyTorchJob, said in a note.
- an explicit gpumem: "fits with X MiB headroom", or refused with the flags that would fit.
- a slice below one CUDA context is always refused (plan/slice.py MIN_SLICE_MIB).
- `--no-plan`: skipped, with the reason said; `auto` then cannot be resolved and is refused.
A job whose model disttrain does not know (a script) is not planned; an explicit slice
that the plan cannot trace (an op fake tensors do not support) is rendered with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disttrain.plan.slice import too_small


@dataclass
class SliceVerdict:
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusal: str | None = None
    plan: Any = None


def check_slice(spec: Any, plan: bool = True) -> SliceVerdict:
    """Check (and for `auto`, set) `spec.cluster.gpumem`; see the module docstring."""
    out = SliceVerdict()
    cluster = spec.cluster
    gpumem = cluster.gpumem
    if cluster.gpus < 1 or gpumem is None:
        return out
    if isinstance(gpumem, int):
        out.refusal = too_small(gpumem)
        if out.refusal:
            return out
    if not plan:
        if gpumem == "auto":
            out.refusal = ("cluster.gpumem auto needs the memory plan, and --no-plan skips it: "
                           "drop --no-plan, or give gpumem in MiB")
        else:
            out.notes.append(f"memory plan skipped (--no-plan): the {gpumem} MiB slice is not "
                             f"checked against the job's memory")
        return out
    if spec.script:
        if gpumem == "auto":
            out.refusal = ("cluster.gpumem auto: a script's model is not known to disttrain, so "
                           "there is no plan to take the request from; give gpumem in MiB, or "
                           "train a --task (docs/memory.md)")
        return out
    from disttrain.plan.job import plan_job
    from disttrain.plan.text import refusal, verdict

    try:
        made = plan_job(spec)
    except Exception as exc:   # any failure of the fake trace: an op it cannot run
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if gpumem == "auto":
            out.refusal = (f"cluster.gpumem auto: the job could not be planned ({reason}); "
                           f"give gpumem in MiB")
        else:
            out.warnings.append(f"the {gpumem} MiB slice is not checked: the job could not be "
                                f"planned ({reason}); --no-plan skips the attempt")
        return out
    out.plan = made
    if gpumem == "auto":
        cluster.gpumem = made.gpumem_mib
        out.notes.append(f"gpumem {made.gpumem_mib} MiB per GPU from the memory plan (tensor "
                         f"peak {made.peak_bytes / 2**20:,.1f} MiB per rank in "
                         f"{made.tensors.phase}; `disttrain plan` shows it)")
    elif made.fits:
        out.notes.append(verdict(made))
    else:
        out.refusal = refusal(made)
    return out
