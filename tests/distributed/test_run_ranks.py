"""`disttrain.testing.run_ranks` bounds the wall clock, not only the collectives: a rank
stuck outside any collective (here: asleep) ends the run after `wall_s`, named with
where it was; a rank that had returned is not named. Real ranks (gloo, 2 processes)."""

from __future__ import annotations

import time

import pytest

from disttrain.testing import RanksTimedOut, run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _rank1_sleeps_forever() -> int:
    import torch.distributed as dist

    with setup_for_test():
        rank = dist.get_rank()
    if rank == 1:
        while True:           # stuck outside a collective: no collective timeout fires
            time.sleep(0.2)
    return rank


def _both_return() -> int:
    import torch.distributed as dist

    with setup_for_test():
        return dist.get_rank()


def test_a_rank_stuck_outside_a_collective_is_named_after_wall_s():
    started = time.monotonic()
    with pytest.raises(RanksTimedOut) as caught:
        run_ranks(2, _rank1_sleeps_forever, timeout_s=120, wall_s=8)
    took = time.monotonic() - started
    text = str(caught.value)
    assert text.startswith("rank(s) 1 still running 8 s after the ranks started"), text
    assert "_rank1_sleeps_forever" in text and "rank 0" not in text, text
    print(f"\nstuck rank -> RanksTimedOut after {took:.1f} s (wall_s 8, timeout_s 120)")
    assert took < 120   # not the collective timeout: nothing would have ended it


def test_ranks_that_return_in_time_are_untouched():
    assert run_ranks(2, _both_return, timeout_s=120) == {0: 0, 1: 1}
