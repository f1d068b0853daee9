"""Activations between pipeline stages for evaluation (distributed/stage_link.py): sends that
do not wait, one header per (sender, stage), tensors read back in the order they were made."""

from __future__ import annotations

import pytest
import torch

from disttrain.distributed.stage_link import StageLink
from disttrain.errors import StrategyError
from disttrain.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _two_stages_each_way(_: int) -> list[list[float]]:
    import torch.distributed as dist

    from disttrain.testing import setup_for_test

    with setup_for_test() as rt:
        link, got = StageLink(dist.group.WORLD), []
        if rt.rank == 0:   # stage 0: three (2, 3) floats, then stage 2: two int64 vectors
            for i in range(3):
                link.send(torch.full((2, 3), float(i)), dst=1, stage=0)
            for i in range(2):
                link.send(torch.arange(4, dtype=torch.int64) + 10 * i, dst=1, stage=2)
            got.append(link.recv(1, 1, rt.device).flatten().tolist())
        else:   # every send of rank 0 is posted before rank 1 reads any
            for _ in range(3):
                got.append(link.recv(0, 0, rt.device).flatten().tolist())
            for _ in range(2):
                t = link.recv(0, 2, rt.device)
                assert t.dtype == torch.int64
                got.append([float(v) for v in t.tolist()])
            link.send(torch.tensor([[7.0]]), dst=0, stage=1)
        link.wait()
    return got


def test_tensors_arrive_in_order_with_one_header_per_stage():
    out = run_ranks(2, _two_stages_each_way, 0, timeout_s=60)
    assert out[0] == [[7.0]]
    assert out[1] == [[0.0] * 6, [1.0] * 6, [2.0] * 6, [0.0, 1.0, 2.0, 3.0],
                      [10.0, 11.0, 12.0, 13.0]]


def test_a_tensor_it_cannot_describe_is_refused_before_anything_is_sent():
    link = StageLink(group=None)
    with pytest.raises(StrategyError, match=r"cannot pass a torch\.bool tensor"):
        link.send(torch.zeros(2, dtype=torch.bool), dst=1, stage=0)
    assert not link._pending
