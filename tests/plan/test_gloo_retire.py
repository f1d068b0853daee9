"""Why a real FSDP run's memory on gloo is now the same every time (docs/memory.md): gloo's
worker thread can still hold a finished collective's tensors after the synchronous call
returned; `distributed.fsdp._retired` returns only once it let go, and `wrap_fsdp` routes
FSDP2's all-gathers through it and its reduce-scatters through `InPlaceReduceScatter`
(gloo's algorithm without the private clone of the input that its worker freed late)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROUNDS = 100
STEPS = 12


def _tower() -> Any:
    from torch import nn

    return nn.Sequential(nn.Sequential(nn.Linear(48, 384), nn.GELU()),
                         nn.Sequential(nn.Linear(384, 384), nn.GELU()), nn.Linear(384, 4))


def _rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from disttrain.distributed.fsdp import _retired, wrap_fsdp
    from disttrain.testing import setup_for_test

    with setup_for_test() as rt:
        rank = dist.get_rank()
        out, inp = torch.empty(2 * 4096), torch.ones(4096)
        held = 0
        for _ in range(ROUNDS):
            view = inp.view(-1)
            alive = weakref.ref(view)   # only the collective's work holds the view's TensorImpl
            _retired(lambda o, v: dist.all_gather_into_tensor(o, v, async_op=True),
                     (out, view), False)
            del view
            held += alive() is not None
            torch.randn(128, 128) @ torch.randn(128, 128)   # main-thread work in between

        model = wrap_fsdp(_tower(), rt, min_params=1000)
        comms, reduce_scatter = set(), None
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is not None:
                group = get_state()._fsdp_param_group
                if group is None:   # the root: every parameter is in a unit
                    continue
                comms |= {type(group._all_gather_comm).__name__,
                          type(group._reduce_scatter_comm).__name__}
                reduce_scatter = group._reduce_scatter_comm
        # the in-place reduce-scatter against gloo's own, SUM and AVG (FSDP's fp32 op)
        same = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            for dtype in (torch.float32, torch.bfloat16):   # bf16: --comm-hook bf16
                source = (torch.arange(8.0) * (rank + 1)).to(dtype)
                ours, theirs = torch.empty(4, dtype=dtype), torch.empty(4, dtype=dtype)
                dist.reduce_scatter_tensor(theirs, source.clone(), op=op)
                reduce_scatter(ours, source.clone(), dist.group.WORLD, op)
                same[f"{op} {dtype}"] = torch.equal(ours, theirs)

        # the tracked peak of one training step, again and again: a buffer gloo's worker
        # frees late shows as a higher peak in some steps
        opt = torch.optim.Adam(model.parameters())
        x, y = torch.randn(64, 48), torch.randint(0, 4, (64,))
        peaks = []
        for _ in range(STEPS):
            tracker = FSDPMemTracker(model, opt)
            with tracker:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            peaks.append(max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()))
        return {"held": held, "comms": sorted(comms), "gathered": out[4096:].sum().item(),
                "same": same, "peaks": peaks}


def test_retired_collectives_leave_nothing_to_gloos_worker() -> None:
    from disttrain.testing import run_ranks

    for rank, r in run_ranks(2, _rank, timeout_s=240).items():
        assert r["held"] == 0, (rank, r)
        assert r["gathered"] == 4096, (rank, r)   # the collective itself still ran
        assert r["comms"] == ["InPlaceReduceScatter", "RetiredAllGather"], (rank, r)
        assert all(r["same"].values()), (rank, r["same"])
        # the first step makes Adam's state; every later step has the same peak
        assert len(set(r["peaks"][1:])) == 1, (rank, r["peaks"])
