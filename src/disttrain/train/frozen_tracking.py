"""torch's memory tracker made to follow a model with frozen parameters (a LoRA base).

    tracker = frozen_aware(MemTracker)()     # the plan's trace and the run's MemoryProbe

`MemTracker` (torch.distributed._tools.mem_tracker) hooks the gradient of every parameter
of every module it meets in a forward, frozen or not, and `register_hook` on a tensor that
does not require a gradient raises ("cannot register a hook on a tensor that doesn't
require gradient"): a LoRA model could be neither planned nor measured. The subclass
counts every parameter as before (a frozen base weight is memory the rank holds) and hooks
the gradients of the trainable ones only, the only ones that get a gradient; a frozen
parameter never has one, and the optimizer is given the trainable ones only
(train/build.py), so frozen weights add parameters and nothing else, in the plan and in
the measurement alike. FSDP2's tracker instruments FSDP's own parameter groups, which skip
frozen parameters' gradients already, and needs no change.

Used by both sides (plan/trace.py, train/memory.py), so it lives below both in train/.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def frozen_aware(tracker_class: type) -> type:
    """`tracker_class` (a MemTracker) whose gradient hooks skip frozen parameters."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    class FrozenAware(tracker_class):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(self, module: nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            # torch's own accounting of the parameters, buffers and existing gradients,
            # without its hooks; then the hooks it would install, on trainable ones only
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = _hook_gradients(self, param)
            return memory

    def _hook_gradients(tracker: Any, param: nn.Parameter) -> tuple[Any, Any]:
        """torch's two hooks (the gradient as computed, then as accumulated), which mark
        the tensor a gradient in the tracker's books."""
        def grad_hook(grad: Any) -> None:
            tracker._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        return (param.register_hook(grad_hook),
                param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)))

    FrozenAware.__name__ = f"FrozenAware{tracker_class.__name__}"
    return FrozenAware
