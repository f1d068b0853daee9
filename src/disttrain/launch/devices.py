"""How many GPUs this process could use, asked without initialising CUDA.

    local_gpu_count()    # 0 on a CPU machine or with CUDA_VISIBLE_DEVICES="" / "-1"

Used where `nproc_per_node: auto` is resolved (`disttrain.launch.argv.resolve_nproc`) and
by `disttrain run`'s up-front checks (fp16 or nccl without a GPU). torch is imported only
when asked, so modules that import this one (the k8s renderer) stay torch-free.
"""

from __future__ import annotations

import os

from disttrain import envvars


def local_gpu_count() -> int:
    """GPUs this process could use, without initialising CUDA (so fork stays safe)."""
    visible = os.environ.get(envvars.CUDA_VISIBLE_DEVICES)
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0
