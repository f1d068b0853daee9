"""`check_in_sync` on real 2-rank gloo groups: silent on a healthy DDP run, and for each
injected fault it names the rank, the first differing tensor and by how much."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disttrain.distributed.sync_check import check_in_sync, reference
from disttrain.testing import run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _ddp_step(model: nn.Module, rank: int, no_sync: bool = False) -> None:
    torch.manual_seed(100 + rank)  # different data per rank, as with a DistributedSampler
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    ctx = model.no_sync() if no_sync else torch.enable_grad()
    with ctx:
        nn.functional.cross_entropy(model(x), y).backward()


def _scenarios() -> dict[str, dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rt = setup_for_test()
    out = {}
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        _ddp_step(model, rt.rank)
        opt.step()
    out["healthy_grads"] = check_in_sync(model, "grads").as_dict()
    out["healthy"] = check_in_sync(model).as_dict()
    # Batch-norm statistics: updated by each rank's last forward, re-broadcast by the next.
    out["state_after_forward"] = check_in_sync(model, "state").as_dict()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))  # DDP broadcasts rank 0's buffers; eval does not update them
    out["state_after_eval_forward"] = check_in_sync(model, "state").as_dict()
    model.train()

    opt.zero_grad()
    _ddp_step(model, rt.rank, no_sync=True)  # fault: gradients never all-reduced
    out["no_sync_grads"] = check_in_sync(model, "grads").as_dict()

    if rt.rank == 1:  # fault: an update made on one rank only
        with torch.no_grad():
            model.module[3].bias.add_(1e-3)
    report = check_in_sync(model)
    out["one_rank_update"] = report.as_dict()
    out["one_rank_update_text"] = report.describe()

    bare = _model()  # fault: no DDP, and rank 1 built different weights
    if rt.rank == 1:
        with torch.no_grad():
            bare[0].weight.mul_(2)
    out["not_wrapped"] = check_in_sync(bare).as_dict()

    from disttrain.distributed.strategies import WrapOptions, wrap

    sharded = wrap(_model(), "fsdp", rt, WrapOptions(fsdp_min_params=1))
    out["fsdp_params"] = check_in_sync(sharded).as_dict()  # gathers the full parameters
    if rt.rank == 1:
        with torch.no_grad():
            next(iter(sharded.parameters())).add_(1.0)  # the only copy of this shard
    out["fsdp_shard_changed"] = check_in_sync(sharded).as_dict()
    try:
        check_in_sync(sharded, "grads")
        out["fsdp_grads"] = "accepted"
    except ValueError as exc:
        out["fsdp_grads"] = str(exc)
    return out


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return run_ranks(2, _scenarios, timeout_s=90)


def test_every_rank_gets_the_same_report(reports):
    assert reports[0] == reports[1]


def test_healthy_ddp_is_in_sync(reports):
    for key in ("healthy", "healthy_grads"):
        r = reports[0][key]
        assert r["in_sync"] is True and r["diverged_ranks"] == [], key
        assert len(set(r["digests"])) == 1


def test_buffers_differ_after_a_training_forward_until_ddp_rebroadcasts(reports):
    r = reports[0]["state_after_forward"]
    assert r["diverged_ranks"] == [1] and r["first_diverged"] == "1.running_mean"
    assert reports[0]["state_after_eval_forward"]["in_sync"] is True


def test_no_sync_gradients_are_caught(reports):
    r = reports[0]["no_sync_grads"]
    assert r["in_sync"] is False and r["diverged_ranks"] == [1] and r["reference_rank"] == 0
    assert r["first_diverged"] == "0.weight" and r["max_abs_diff"] > 0


def test_one_rank_update_is_named_with_its_size(reports):
    r = reports[0]["one_rank_update"]
    assert r["diverged_ranks"] == [1] and r["first_diverged"] == "3.bias"
    assert r["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    text = reports[0]["one_rank_update_text"]
    assert "rank(s) 1 differ from rank 0 first in '3.bias'" in text and "Usual causes" in text


def test_unwrapped_models_with_different_weights_are_caught(reports):
    r = reports[0]["not_wrapped"]
    assert r["diverged_ranks"] == [1] and r["first_diverged"] == "0.weight"
    assert r["max_abs_diff"] > 0


def test_fsdp_parameters_are_gathered_and_compared(reports):
    """Each FSDP shard exists once, so every rank gathers the same full parameters even
    after one rank changed its shard: that is a different model, not a desync."""
    assert reports[0]["fsdp_params"]["in_sync"] is True
    changed = reports[0]["fsdp_shard_changed"]
    assert changed["in_sync"] is True
    assert changed["digests"][0] != reports[0]["fsdp_params"]["digests"][0]
    assert "FSDP shards gradients" in reports[0]["fsdp_grads"]


def test_single_process_is_trivially_in_sync():
    report = check_in_sync(_model())
    assert report.in_sync and report.world_size == 1 and "identical on all 1 ranks" in report.describe()


def test_reference_is_the_majority_then_the_lowest_rank():
    assert reference(["a", "b", "b"]) == (1, [0])
    assert reference(["a", "b"]) == (0, [1])
    assert reference(["a", "a", "c", "a"]) == (0, [2])


def test_bad_what_is_refused():
    with pytest.raises(ValueError, match="'params', 'grads' or 'state'"):
        check_in_sync(_model(), "weights")  # type: ignore[arg-type]
