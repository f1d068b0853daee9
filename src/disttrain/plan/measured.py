"""What a rank of a real run holds, measured the way the plan traces it: for checking the
plan against real ranks (tests/plan/test_parallel_accuracy.py, benchmarks/plan_parallel.py).

    with setup_for_test() as rt:                  # inside run_ranks(2, ...)
        figures = measure_rank(spec, rt)          # {"tensor_peak_bytes", "param_bytes", ...}

The job is built by the run's own `build_trainer` (the same split, wrapping and optimizer as
`disttrain run`) and two optimizer steps run under torch's memory tracker, as the
Trainer's `MemoryProbe` does on the CPU. The Trainer leaves the probe off under pp (the
schedule runs the stage once per micro-batch, which MemTracker refuses), so a pipeline
stage is measured here with `parallel.stage_tracker`, the tracker the plan traces it with.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_bytes", "measure_rank"]


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds for `tensors` (a DTensor counts its local shard; a storage
    shared by several tensors, such as a tied weight, once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        key = storage.data_ptr() if storage.data_ptr() else id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def measure_rank(spec: Any, rt: Any, task: Any = None, timed_steps: int = 0) -> dict[str, Any]:
    """Two optimizer steps of `spec`'s job on this rank: its tracked tensor peak and the
    bytes of its parameters, gradients (before they are freed) and optimizer state; then
    `timed_steps` more, untracked, for the job's samples/s (every data slice's samples;
    a collective per step keeps the ranks together, so each rank's figure is the job's)."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrain.plan.parallel import stage_tracker
    from disttrain.train.batch import to_device
    from disttrain.train.build import build_trainer
    from disttrain.train.memory import MemoryProbe
    from disttrain.train.steps import run_step

    trainer = build_trainer(spec, rt) if task is None else build_trainer(spec, rt, task)
    model, opt, amp, par = trainer.model, trainer.optimizer, trainer.precision, trainer.parallel
    pipe = par.pipe if par is not None else None
    params = par.parameters() if par is not None else [p for p in model.parameters()
                                                        if p.requires_grad]
    # both batches read before tracking: a dataset that slices one long tensor (chargpt's
    # windows) hands out views whose storage, the whole text, the tracker would count
    batches = iter(trainer.loader)
    data_of = [to_device(next(batches), rt.device) for _ in (1, 2)]
    probe = None if pipe is not None else MemoryProbe(model, opt, rt.device)
    tracker: Any = None
    grad_bytes = 0
    for step in (1, 2):
        data = data_of[step - 1]
        if pipe is not None:
            if tracker is None:
                tracker = stage_tracker()
                tracker.track_external(model, opt, *[t for t in data if isinstance(t, torch.Tensor)])
                tracker.__enter__()
            tracker.reset_mod_stats()
            with amp.autocast():
                par.pipeline_step(data, 1.0)
        else:
            assert probe is not None
            probe.before_micro(data)
            with amp.autocast():
                loss, _ = run_step(trainer.task, model, data)
            amp.backward(loss)
            del loss
        if par is not None:
            par.before_optimizer_step()
        grad_bytes = max(grad_bytes, local_bytes(p.grad for p in params))
        amp.step(opt)
        opt.zero_grad(set_to_none=not isinstance(model, DDP))
        if probe is not None:
            probe.after_step(step)
    if tracker is not None:
        tracker.__exit__(None, None, None)
        from disttrain.plan.trace import device_snapshot, fold, total_of

        snap = device_snapshot(tracker, "peak")
        peak, at_peak = total_of(snap), fold(snap)
    else:
        assert probe is not None
        peak, at_peak = probe.fields()["tensor_peak_bytes"], {}
    state = [v for s in opt.state.values() for v in s.values()]
    held = list(pipe.stage_module.parameters()) if pipe is not None else list(model.parameters())
    samples_per_s = None
    if timed_steps:
        slices = par.dp_size if par is not None else rt.world_size
        start, rows = time.perf_counter(), 0
        for _ in range(timed_steps):
            data = to_device(next(batches), rt.device)
            rows += len(data[0]) if isinstance(data, (list, tuple)) else spec.train.batch_size
            if pipe is not None:
                with amp.autocast():
                    par.pipeline_step(data, 1.0)
            else:
                with amp.autocast():
                    loss, _ = run_step(trainer.task, model, data)
                amp.backward(loss)
            if par is not None:
                par.before_optimizer_step()
            amp.step(opt)
            opt.zero_grad(set_to_none=not isinstance(model, DDP))
        samples_per_s = rows * slices / (time.perf_counter() - start)
    if trainer.writer is not None:
        trainer.writer.close()
    return {"samples_per_s": samples_per_s, "tensor_peak_bytes": peak, "param_bytes": local_bytes(held),
            "grad_bytes": grad_bytes, "optimizer_bytes": local_bytes(state),
            "stage": pipe.stage_index if pipe is not None else None, "at_peak": at_peak}
