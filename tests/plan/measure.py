"""The real side of the plan-accuracy tests: one job built as `disttrain run` builds it
(`build_trainer`), two optimizer steps under the Trainer's MemoryProbe, on a real rank."""

from __future__ import annotations

from typing import Any

TOLERANCE = 0.10   # the plan's tensor peak vs the real run's tracked one, both ways


def tracked_two_steps(spec: Any, rt: Any, task: Any = None) -> tuple[dict[str, Any], int]:
    """The MemoryProbe's fields after two steps of `spec` (with `task`, or the spec's own),
    and the number of trainable parameters the run built."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrain.train.batch import to_device
    from disttrain.train.build import build_trainer
    from disttrain.train.memory import MemoryProbe
    from disttrain.train.steps import run_step

    trainer = build_trainer(spec, rt) if task is None else build_trainer(spec, rt, task)
    model, opt, amp = trainer.model, trainer.optimizer, trainer.precision
    probe = MemoryProbe(model, opt, rt.device)
    batches = iter(trainer.loader)
    for step in (1, 2):
        data = to_device(next(batches), rt.device)
        probe.before_micro(data)
        with amp.autocast():
            loss, _ = run_step(trainer.task, model, data)
        amp.backward(loss)
        del loss
        amp.step(opt)
        opt.zero_grad(set_to_none=not isinstance(model, DDP))
        probe.after_step(step)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainer.writer is not None:
        trainer.writer.close()
    return probe.fields(), trainable
