"""Checkpoints survive a writer killed mid-save, report corrupt files, never run code."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from disttrain.errors import CheckpointError
from disttrain.train.checkpoint import (
    atomic_torch_save,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

pytestmark = pytest.mark.timeout(120)


def state(step: int, size: int = 16) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(size, generator=g)}, "optimizer": {}, "step": step,
            "epoch": 0, "batch_in_epoch": step}


@contextlib.contextmanager
def warnings_of_disttrain():
    """The 'disttrain' logger's records (without pytest's logging plugin, which the
    multi-process suites run without)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger, handler = logging.getLogger("disttrain"), Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_save_load_prune_and_last_link(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, state(step), step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000030.pt", "ckpt-00000020.pt"]
    assert os.path.samefile(tmp_path / "last.pt", tmp_path / "ckpt-00000030.pt")
    found = load_latest(tmp_path)
    assert found is not None
    ckpt, path = found
    assert ckpt["step"] == 30 and path.name == "ckpt-00000030.pt"
    assert torch.equal(ckpt["model"]["w"], state(30)["model"]["w"])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_newest_numbered_beats_a_stale_last_pt(tmp_path):
    """A writer killed between renaming ckpt-30 and re-pointing last.pt."""
    save_checkpoint(tmp_path, state(20), 20)
    atomic_torch_save(state(30), tmp_path / "ckpt-00000030.pt")
    found = load_latest(tmp_path)
    assert found is not None and found[0]["step"] == 30


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_damaged_newest_is_reported_and_the_previous_loaded(tmp_path, damage):
    save_checkpoint(tmp_path, state(10, 4096), 10)
    save_checkpoint(tmp_path, state(20, 4096), 20)
    bad = tmp_path / "ckpt-00000020.pt"
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":  # inside the tensor data: torch.load alone would not notice
        data[len(data) // 2] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a checkpoint\n" * 100)
    bad.write_bytes(bytes(data))  # last.pt is the same inode: it is damaged too
    with warnings_of_disttrain() as warned:
        found = load_latest(tmp_path)
    assert found is not None
    ckpt, path = found
    assert ckpt["step"] == 10 and path.name == "ckpt-00000010.pt"
    assert any("ckpt-00000020.pt" in w for w in warned), warned
    with pytest.raises(CheckpointError, match=r"ckpt-00000020\.pt"):
        load_checkpoint(bad)


def test_nothing_loadable_is_none(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    (tmp_path / "ckpt-00000005.pt").write_bytes(b"\x00" * 10)
    with warnings_of_disttrain() as warned:
        assert load_latest(tmp_path) is None
    assert len(warned) == 1


def test_not_a_disttrain_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="not a disttrain checkpoint"):
        load_checkpoint(tmp_path / "x.pt")


class _Evil:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, fmt):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt-00000001.pt"
    payload = {"model": _Evil(marker), "step": 1}
    torch.save(payload, path, _use_new_zipfile_serialization=(fmt == "zip"))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    with warnings_of_disttrain() as warned:
        assert load_latest(tmp_path) is None
    assert warned and not marker.exists(), "loading must never run code from the file"
    # The check can fail: an unsafe load of the same file does run the code.
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


def test_rng_state_roundtrips_through_a_safe_load(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    saved = rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    save_checkpoint(tmp_path, {**state(1), "rng": [saved]}, 1)
    found = load_latest(tmp_path)
    assert found is not None
    set_rng_state(found[0]["rng"][0])
    assert torch.equal(torch.rand(3), expected[0])
    assert (np.random.rand(3) == expected[1]).all() and random.random() == expected[2]


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import disttrain.train.checkpoint as ck

    ckpt_dir = Path(sys.argv[1])
    ck.save_checkpoint(ckpt_dir, {"model": {"w": torch.ones(4)}, "step": 1}, 1)
    real_save = torch.save

    class Slow:
        # a file whose writes take a while, so the kill lands inside torch.save
        def __init__(self, f):
            self.f = f
        def write(self, b):
            time.sleep(0.002)
            return self.f.write(b)
        def flush(self):
            self.f.flush()

    def slow_save(obj, f, **kw):
        print("writing", flush=True)
        return real_save(obj, Slow(f), **kw)

    ck.torch.save = slow_save
    big = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(64)}, "step": 2}
    ck.save_checkpoint(ckpt_dir, big, 2)
    print("finished", flush=True)
""")


def test_writer_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    ckpt_dir = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt_dir)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        deadline = time.time() + 60
        tmp = []
        while time.time() < deadline:  # kill once the temp file has real content
            tmp = [p for p in ckpt_dir.iterdir() if p.name.endswith(".tmp")]
            if tmp and tmp[0].stat().st_size > 1 << 20:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert tmp, "the writer never started writing"
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["ckpt-00000001.pt"]
    found = load_latest(ckpt_dir)
    assert found is not None and found[0]["step"] == 1, "the previous checkpoint must load"
    assert tmp[0].exists(), "a half-written temp file is left, never renamed into place"
    save_checkpoint(ckpt_dir, state(3), 3)  # the next save clears what the dead writer left
    assert not [p for p in ckpt_dir.iterdir() if p.name.endswith(".tmp")]
    found = load_latest(ckpt_dir)
    assert found is not None and found[0]["step"] == 3


# -- the Trainer's checkpoints: what is saved, the resume policy ---------------------------
class _OneRank:
    """Enough of a Runtime for the Checkpointer at world size 1 (or a pretended other
    world size, or other ranks' answers to the all-gather)."""

    def __init__(self, world_size: int = 1, others: list | None = None):
        self.rank, self.world_size, self.is_rank0, self.others = 0, world_size, True, others

    def all_gather_object(self, obj):
        return [obj, *self.others] if self.others is not None else [obj] * self.world_size

    def barrier(self) -> None:
        pass


def _parts(seed: int):
    from disttrain.train.optim import build_optimizer, warmup_lambda
    from disttrain.train.precision import Precision

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer("adam", model.parameters(), 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(5))
    return model, opt, sched, Precision.create("fp32", torch.device("cpu"))


def test_checkpointer_restores_parts_position_and_rng(tmp_path):
    from disttrain.train.checkpoint import Checkpointer, TrainState

    model, opt, sched, amp = _parts(0)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    sched.step()
    ckpt = Checkpointer(_OneRank(), tmp_path, model, opt, sched, amp)
    ckpt.save(TrainState(epoch=1, batch_in_epoch=3, step=7, samples=100), write=True)
    after_save = torch.rand(3)

    fresh = _parts(1)
    found = Checkpointer(_OneRank(), tmp_path, *fresh).restore()
    assert found is not None
    restored, path = found
    assert restored == TrainState(1, 3, 7, 100) and path.name == "ckpt-00000007.pt"
    assert torch.equal(torch.rand(3), after_save), "the RNG continues where the save left it"
    assert torch.equal(fresh[0].weight, model.weight)
    assert fresh[1].state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert fresh[2].state_dict() == sched.state_dict()
    saved = load_checkpoint(path)  # the plain weights, loadable without disttrain
    assert set(saved["model"]) == {"weight", "bias"} and saved["world_size"] == 1


def test_checkpointer_without_write_leaves_the_file_to_rank0(tmp_path):
    from disttrain.train.checkpoint import Checkpointer, TrainState

    Checkpointer(_OneRank(), tmp_path, *_parts(0)).save(TrainState(step=2), write=False)
    assert list_checkpoints(tmp_path) == []
    assert Checkpointer(_OneRank(), tmp_path, *_parts(0)).restore() is None


def test_resume_refuses_another_world_size_and_ranks_that_disagree(tmp_path):
    from disttrain.train.checkpoint import Checkpointer, TrainState

    Checkpointer(_OneRank(), tmp_path, *_parts(0)).save(TrainState(step=5), write=True)
    with pytest.raises(CheckpointError, match="saved with world size 1, this job has 2"):
        Checkpointer(_OneRank(world_size=2), tmp_path, *_parts(0)).restore()
    disagree = _OneRank(world_size=2, others=[None])
    with pytest.raises(CheckpointError, match=r"different checkpoints .*step by rank: \[5, None\]"):
        Checkpointer(disagree, tmp_path, *_parts(0)).restore()


def test_resume_is_requested_by_the_flag_or_a_torchrun_restart(monkeypatch):
    from disttrain.train.checkpoint import resume_requested

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume_requested(True) and not resume_requested(False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_requested(False)
