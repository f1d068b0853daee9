"""Storage faults: the integrity record, a damaged newest checkpoint, a full disk (docs/resilience.md)."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

import disttrain.train.ckpt_integrity as integrity
from disttrain.errors import CheckpointError
from disttrain.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from disttrain.train.ckpt_integrity import manifest_path, verify_manifest
from tests.train.test_checkpoint import _OneRank, _parts, state, warnings_of_disttrain

pytestmark = pytest.mark.timeout(120)


def _two(tmp_path, size: int = 4096):
    for step in (10, 20):
        save_checkpoint(tmp_path, state(step, size), step)
    return tmp_path / "ckpt-00000020.pt"


def test_every_checkpoint_has_a_manifest_of_its_files(tmp_path):
    newest = _two(tmp_path)
    record = json.loads(manifest_path(newest).read_text())
    entry = record["files"]["ckpt-00000020.pt"]
    assert entry["bytes"] == newest.stat().st_size
    assert entry["sha256"] == integrity.file_digest(newest)[1]
    assert verify_manifest(newest) is True
    save_checkpoint(tmp_path, state(30), 30)  # pruning takes the manifest with its checkpoint
    assert sorted(p.name for p in tmp_path.glob("*.manifest.json")) == [
        "ckpt-00000020.manifest.json", "ckpt-00000030.manifest.json"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_is_named_with_what_is_wrong_and_the_previous_loaded(tmp_path, damage):
    newest = _two(tmp_path)
    data = bytearray(newest.read_bytes())
    size = len(data)
    if damage == "truncate":
        data = data[: size - 100]
    else:
        data[size // 2] ^= 0x01  # one bit
    newest.write_bytes(bytes(data))
    with warnings_of_disttrain() as warned:
        found = load_latest(tmp_path)
    assert found is not None and found[1].name == "ckpt-00000010.pt"
    assert len(warned) == 1, warned
    what = (f"truncated ({size - 100} bytes, its manifest records {size})" if damage == "truncate"
            else "corrupt (its sha256 differs from the one ckpt-00000020.manifest.json records)")
    assert f"ckpt-00000020.pt: {what}" in warned[0]


def test_a_damaged_file_of_a_sharded_checkpoint_is_named(tmp_path):
    """The manifest also records the DCP folder's files; one of them changed is found
    before anything is loaded."""
    save_checkpoint(tmp_path, state(10), 10)
    shard = tmp_path / "dcp-00000020" / "__0_0.distcp"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 1000)
    files = integrity.folder_digests(shard.parent, "dcp-00000020")
    save_checkpoint(tmp_path, state(20), 20, files=files)
    assert load_latest(tmp_path)[1].name == "ckpt-00000020.pt"  # intact: loads
    shard.write_bytes(b"x" * 999 + b"y")
    with warnings_of_disttrain() as warned:
        found = load_latest(tmp_path)
    assert found is not None and found[1].name == "ckpt-00000010.pt"
    assert "dcp-00000020/__0_0.distcp: corrupt" in warned[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing"):
        load_checkpoint(tmp_path / "ckpt-00000020.pt")


def test_an_unreadable_manifest_is_named_and_the_previous_loaded(tmp_path):
    newest = _two(tmp_path)
    manifest_path(newest).write_text('{"format": 1, "files": ')
    with warnings_of_disttrain() as warned:
        found = load_latest(tmp_path)
    assert found is not None and found[1].name == "ckpt-00000010.pt"
    assert "ckpt-00000020.pt: its integrity record ckpt-00000020.manifest.json is unreadable" in warned[0]


def test_a_checkpoint_without_a_manifest_still_loads(tmp_path):
    """Written by an older disttrain: the zip's CRC-32 and weights_only=True still apply."""
    newest = _two(tmp_path)
    manifest_path(newest).unlink()
    assert verify_manifest(newest) is False
    found = load_latest(tmp_path)
    assert found is not None and found[0]["step"] == 20
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with warnings_of_disttrain() as warned:
        assert load_latest(tmp_path)[0]["step"] == 10
    assert "fails its CRC-32 check" in warned[0]


def test_a_save_after_falling_back_drops_the_damaged_newer_one(tmp_path):
    newest = _two(tmp_path)
    newest.write_bytes(newest.read_bytes()[:100])
    assert load_latest(tmp_path)[0]["step"] == 10
    (tmp_path / "dcp-00000020").mkdir()       # its shards, and those of a save killed midway
    (tmp_path / ".dcp-00000030.tmp").mkdir()
    save_checkpoint(tmp_path, state(15), 15)  # the resumed run's next save, another cadence
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000015.pt", "ckpt-00000010.pt"]
    assert not manifest_path(newest).exists()
    assert not list(tmp_path.glob("*dcp-*"))


def _full(code: int, after: int = 0):
    """A write() that fails with `code` once `after` bytes went through."""
    real = integrity.HashingWriter.write

    def write(self, data):
        if self.size + len(memoryview(data).cast("B")) > after:
            self.f.write(bytes(memoryview(data).cast("B")[: max(after - self.size, 0)]))
            self.error = OSError(code, os.strerror(code))
            raise self.error
        return real(self, data)

    return write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_path_bytes_needed_and_free_and_keeps_the_previous(tmp_path, monkeypatch,
                                                                            code):
    save_checkpoint(tmp_path, state(10, 4096), 10)
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(integrity.HashingWriter, "write", _full(code, after=5000))
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, state(20, 65536), 20)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "ckpt-00000020.pt") in message
    assert ("no space left on device" if code == errno.ENOSPC else "disk quota exceeded") in message
    needed = int(message.split("needs about ")[1].split()[0])
    assert 65536 * 4 <= needed < 65536 * 4 + 10_000
    free = int(message.split(", ")[1].split()[0])
    assert abs(free - shutil.disk_usage(tmp_path).free) < 50 << 20
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing of the failed save is left"
    monkeypatch.undo()
    found = load_latest(tmp_path)
    assert found is not None and found[0]["step"] == 10 and verify_manifest(found[1])


def test_a_full_disk_at_the_manifest_removes_the_new_file(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(10), 10)

    def no_room(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("disttrain.train.checkpoint.write_manifest", no_room)
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_checkpoint(tmp_path, state(20), 20)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000010.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _save_on_a_full_disk(base: str) -> str:
    """Rank 0's disk is full during the save: every rank must learn of it from the save
    itself (the closing all-gather), not from a collective timeout."""
    from pathlib import Path

    from disttrain.testing import setup_for_test
    from disttrain.train.checkpoint import Checkpointer, TrainState

    with setup_for_test() as rt:
        if rt.is_rank0:
            integrity.HashingWriter.write = _full(errno.ENOSPC, after=100)
        ckpt = Checkpointer(rt, Path(base), *_parts(0))
        try:
            ckpt.save(TrainState(step=3), write=rt.is_rank0)
        except CheckpointError as exc:
            return str(exc)
        return "saved"


@pytest.mark.slow
def test_every_rank_raises_the_writers_disk_full_error(tmp_path):
    from disttrain.testing import run_ranks

    out = run_ranks(2, _save_on_a_full_disk, str(tmp_path), timeout_s=60)
    assert out[0] == out[1] and "ckpt-00000003.pt: no space left on device" in out[1], out
    assert list_checkpoints(tmp_path) == []


def test_checkpointer_on_one_rank_raises_the_error_of_its_save(tmp_path, monkeypatch):
    from disttrain.train.checkpoint import Checkpointer, TrainState

    monkeypatch.setattr(integrity.HashingWriter, "write", _full(errno.ENOSPC))
    with pytest.raises(CheckpointError, match="no space left on device"):
        Checkpointer(_OneRank(), tmp_path, *_parts(0)).save(TrainState(step=2), write=True)
    assert not list(tmp_path.iterdir())
