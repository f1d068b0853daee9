"""Why a real FSDP run's memory on gloo is now the same every time (docs/memory.md): gloo's
worker thread can still hold a finished collective's tensors after the synchronous call
returned; `distributed.fsdp._retired` returns only once it let go, and `wrap_fsdp` routes
FSDP2's all-gathers and reduce-scatters through it on gloo."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROUNDS = 100


def _rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from disttrain.distributed.fsdp import _retired, wrap_fsdp
    from disttrain.testing import setup_for_test

    with setup_for_test() as rt:
        out, inp = torch.empty(2 * 4096), torch.ones(4096)
        held = 0
        for _ in range(ROUNDS):
            view = inp.view(-1)
            alive = weakref.ref(view)   # only the collective's work holds the view's TensorImpl
            _retired(lambda v: dist.all_gather_into_tensor(out, v, async_op=True), view, False)
            del view
            held += alive() is not None
            torch.randn(128, 128) @ torch.randn(128, 128)   # main-thread work in between
        model = wrap_fsdp(nn.Sequential(nn.Linear(64, 2048), nn.Linear(2048, 8)), rt,
                          min_params=1000)
        comms = set()
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is not None:
                group = get_state()._fsdp_param_group
                if group is None:   # the root: every parameter is in a unit
                    continue
                comms |= {type(group._all_gather_comm).__name__,
                          type(group._reduce_scatter_comm).__name__}
        model(torch.randn(4, 64)).sum().backward()
        return {"held": held, "comms": sorted(comms), "gathered": out[4096:].sum().item()}


def test_retired_collectives_leave_nothing_to_gloos_worker() -> None:
    from disttrain.testing import run_ranks

    for rank, r in run_ranks(2, _rank, timeout_s=240).items():
        assert r["held"] == 0, (rank, r)
        assert r["gathered"] == 4096, (rank, r)   # the collective itself still ran
        assert r["comms"] == ["RetiredAllGather", "RetiredReduceScatter"], (rank, r)
