"""`WaitTuner` in a real 2-rank DDP job (gloo): with `DISTTRAIN_COMM_WAIT=auto` on a
machine whose cores allow polling, the ranks poll and block in the same steps of the first
trial, and the model they train is the same on both (distributed/comm_wait.py)."""

from __future__ import annotations

import hashlib

import pytest

from disttrain.distributed.comm_wait import SETTLE_STEPS, TRIAL_STEPS, usable_cpus
from disttrain.testing import run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
STEPS = SETTLE_STEPS + 2 * TRIAL_STEPS + 4   # the first trial and a few steps after it


def _train() -> tuple[str | None, list[bool], str]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrain.distributed.comm_hooks import register_comm_hook

    with setup_for_test():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 4)))
        stats = register_comm_hook(model, "none", STEPS, poll=True)
        ways: list[bool] = []
        if stats.tuner is not None:   # record each step's way as the tuner gives it
            tuner_poll_now = stats.tuner.poll_now

            def recording(now: float) -> bool:
                ways.append(tuner_poll_now(now))
                return ways[-1]

            stats.tuner.poll_now = recording   # type: ignore[method-assign]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(STEPS):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            stats.end_step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        sha = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        return stats.summary().get("comm_wait"), ways, sha


def test_the_ranks_try_both_ways_together_and_stay_in_sync():
    if usable_cpus() < 2:
        pytest.skip("2 ranks x 1 thread need 2 CPUs for polling to be tried at all")
    results = run_ranks(2, _train, env={"DISTTRAIN_COMM_WAIT": "auto"})
    (wait0, ways0, sha0), (wait1, ways1, sha1) = results[0], results[1]
    assert sha0 == sha1                                     # the same model on both ranks
    assert len(ways0) == STEPS and " tuned, " in (wait0 or ""), wait0
    first = SETTLE_STEPS
    for ways in (ways0, ways1):       # the first trial, in the same steps on both ranks
        assert ways[first:first + 2 * TRIAL_STEPS] == [True, False] * TRIAL_STEPS
    assert ways0[first + 2 * TRIAL_STEPS:] == [ways0[-1]] * 4   # then one way, kept
    assert "last trial: " in (wait0 or "") and "last trial: " in (wait1 or "")
