"""`disttrain.testing.run_ranks` bounds the wall clock, not only the collectives: a rank
stuck outside any collective (here: asleep) ends the run after `wall_s`, named with
where it was; a rank that had returned is not named; a rank that raised leaves nothing in
the temp folder. Real ranks (gloo, 2 processes)."""

from __future__ import annotations

import tempfile
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


def _rank1_raises() -> int:
    import torch.distributed as dist

    with setup_for_test():
        rank = dist.get_rank()
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
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


def test_a_rank_that_raises_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    """torch's agent would leave a torchelastic_* folder and the failed worker's
    pytorch-errorfile-*.pickle (its traceback) there (launch/agent_scratch.py)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ChildFailedError) as caught:
        run_ranks(2, _rank1_raises, timeout_s=120)
    assert list(caught.value.failures) == [1]
    assert tempfile.gettempdir() == str(tmp_path)   # given back as it was
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in left if n.startswith(("pytorch-errorfile-", "torchelastic_"))] == [], left
