"""Memory planning before launch: does the job fit its GPU slice, and what to ask for.

    from disttrain.plan import plan_job, plan_task, Knobs
    plan = plan_job(spec)            # disttrain plan -f job.yaml
    plan.peak_bytes, plan.gpumem_mib, plan.fits

`job` (the plan of a job), `tracing` (the one entry: data parallel or tp/pp), `trace`
(fake-tensor trace of two steps), `parallel` (the trace of a tp or pp job on its real
split, every pipeline stage), `measured` (a real rank's
figures taken the way the plan traces them), `slice` (tensor peak ->
gpumem), `fit` (knobs that would make it fit), `gate` (the check k8s render and
apply make), `mesh_fit` (tp divides the heads, pp <= the blocks, before launch), `text`
(the printed plan), `feedback` (what a finished run really used, and the slice for next
time). docs/memory.md.
"""


from importlib import import_module
from typing import Any

# Exported lazily (PEP 562): `job` and `trace` import torch, and the package's light
# modules (`mesh_fit`, `gate`, `feedback`) are imported by CLI paths that must not pay for
# it (`disttrain run` of every task, `k8s render`, `disttrain report`).
_EXPORTS = {"Knobs": "trace", "TensorPeak": "trace", "MemoryPlan": "job", "knobs_of": "job",
            "plan_job": "job", "plan_task": "job"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
