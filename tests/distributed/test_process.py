"""`process.own_session`: a rank leads its own session (its own autogroup), as a torchrun
worker does, only when the kernel schedules by session (issue 21)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from disttrain.distributed.process import own_session


def _child(flag: str, q: mp.Queue) -> None:
    before = os.getsid(0)
    made = own_session(Path(flag))
    q.put((made, before, os.getsid(0), os.getpid()))


def _in_child(flag: Path) -> tuple[bool, int, int, int]:
    """own_session in a forked child (never in pytest itself: it would leave the terminal)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(str(flag), q))
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        p.join(timeout=60)


def test_with_autogroup_on_the_rank_leads_a_new_session(tmp_path):
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    made, before, after, pid = _in_child(flag)
    assert made and after == pid != before


def test_with_autogroup_off_or_unknown_nothing_changes(tmp_path):
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("0\n")
    made, before, after, _ = _in_child(flag)
    assert not made and after == before
    made, before, after, _ = _in_child(tmp_path / "missing")
    assert not made and after == before


def test_a_session_leader_stays_as_it_is(tmp_path):
    """torchrun's own workers already lead a session: setsid fails, nothing changes."""
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def twice(q: mp.Queue) -> None:
        first = own_session(flag)
        q.put((first, own_session(flag)))

    p = ctx.Process(target=twice, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) == (True, False)
    finally:
        p.join(timeout=60)
