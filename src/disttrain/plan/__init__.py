"""Memory planning before launch: does the job fit its GPU slice, and what to ask for.

    from disttrain.plan import plan_job, plan_task, Knobs
    plan = plan_job(spec)            # disttrain plan -f job.yaml
    plan.peak_bytes, plan.gpumem_mib, plan.fits

`job` (the plan of a job), `trace` (fake-tensor trace of two steps), `slice` (tensor peak ->
gpumem), `fit` (knobs that would make it fit), `gate` (the check k8s render and
apply make), `mesh_fit` (tp divides the heads, pp <= the blocks, before launch), `text`
(the printed plan), `feedback` (what a finished run really used, and the slice for next
time). docs/memory.md.
"""

from disttrain.plan.job import MemoryPlan, knobs_of, plan_job, plan_task
from disttrain.plan.trace import Knobs, TensorPeak

__all__ = ["Knobs", "MemoryPlan", "TensorPeak", "knobs_of", "plan_job", "plan_task"]
