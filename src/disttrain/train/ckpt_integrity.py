"""A checkpoint's integrity record, and the one error a full disk gives (docs/resilience.md).

    writer = HashingWriter(f); torch.save(obj, writer)   # sha256 of the bytes as written
    write_manifest(ckpt_path, {name: (size, sha256), ...})
    verify_manifest(ckpt_path)                          # CheckpointError naming the file
    raise disk_full(exc, path, needed)                  # ENOSPC / EDQUOT, with bytes free

Every checkpoint `ckpt-<step>.pt` has a manifest `ckpt-<step>.manifest.json` beside it:
the size and sha256 of each file the checkpoint is made of (the .pt file, and under FSDP
every file of its `dcp-<step>/` folder). It is written last, atomically, once the files
it names are complete and their bytes on disk match what was written, so a manifest
names a complete checkpoint and any later change to one of its files (a truncation, a
flipped bit, a half-copied folder) is found before anything is loaded. A checkpoint
without a manifest (written by an older disttrain) is still loaded, with the zip's
CRC-32 checks and `weights_only=True` as before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from disttrain.errors import CheckpointError

MANIFEST_FORMAT = 1
# A full disk and a full quota: the two ways a write runs out of room.
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
Digest = tuple[int, str]  # (bytes, sha256 hex)


def manifest_path(ckpt_path: Path) -> Path:
    """`ckpt-<step>.pt` -> `ckpt-<step>.manifest.json` in the same folder."""
    return ckpt_path.with_name(ckpt_path.name.removesuffix(".pt") + ".manifest.json")


class HashingWriter:
    """A write-only file for `torch.save` that hashes and counts what passes through, so
    the record of a file costs no second read of it while it is written."""

    def __init__(self, f: IO[bytes]):
        self.f, self.size, self.sha = f, 0, hashlib.sha256()
        # torch's C++ writer turns an OSError of write() into a RuntimeError ("unexpected
        # pos"); the original (ENOSPC) is kept here for the caller to raise.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self.f.write(view)
        except OSError as exc:
            self.error = exc
            raise
        self.sha.update(view)
        self.size += len(view)
        return written

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> Digest:
        return self.size, self.sha.hexdigest()


def file_digest(path: Path) -> Digest:
    """Size and sha256 of a file as it is on disk now."""
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()


def folder_digests(folder: Path, prefix: str) -> dict[str, Digest]:
    """Every file under `folder`, named `prefix/<relative path>` (a DCP folder's shards
    and metadata)."""
    return {f"{prefix}/{p.relative_to(folder).as_posix()}": file_digest(p)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def atomic_write(path: Path, write: Callable[[IO[bytes]], None],
                 check: Callable[[Path], None] | None = None) -> None:
    """`write(f)` into a temp file beside `path`, fsync, `check(temp)`, rename: readers see
    the old file or the new one. The temp file is removed when anything fails (a full disk
    included)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_manifest(ckpt_path: Path, files: dict[str, Digest]) -> None:
    """Write the checkpoint's manifest atomically (its last file)."""
    record = {"format": MANIFEST_FORMAT, "files": {
        name: {"bytes": size, "sha256": sha} for name, (size, sha) in sorted(files.items())}}
    data = (json.dumps(record, indent=1) + "\n").encode()
    atomic_write(manifest_path(ckpt_path), lambda f: f.write(data))


def read_manifest(ckpt_path: Path) -> dict[str, Digest] | None:
    """The manifest's files, or None when the checkpoint has none (an older disttrain).

    Raises:
        CheckpointError: the manifest exists but cannot be read.
    """
    path = manifest_path(ckpt_path)
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        return {name: (int(e["bytes"]), str(e["sha256"])) for name, e in files.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{ckpt_path}: its integrity record {path.name} is unreadable "
                              f"({type(exc).__name__})") from None


def verify_manifest(ckpt_path: Path) -> bool:
    """Check every file the manifest names against its size and sha256.

    Returns:
        False when there is no manifest (nothing to check), True when all files match.

    Raises:
        CheckpointError: naming the file and what is wrong: missing, truncated (its size
            against the recorded one) or corrupt (same size, other bytes).
    """
    files = read_manifest(ckpt_path)
    if files is None:
        return False
    for name, (size, sha) in files.items():
        path = ckpt_path.parent / name
        try:
            found = file_digest(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (listed in {manifest_path(ckpt_path).name})"
                                  ) from None
        except OSError as exc:
            raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})") from None
        if found[0] != size:
            what = "truncated" if found[0] < size else "corrupt"
            raise CheckpointError(f"{path}: {what} ({found[0]} bytes, its manifest records {size})")
        if found[1] != sha:
            raise CheckpointError(f"{path}: corrupt (its sha256 differs from the one "
                                  f"{manifest_path(ckpt_path).name} records)")
    return True


# -- a full disk -------------------------------------------------------------------------
def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised as such or wrapped (DCP's CheckpointException carries each
    rank's exception; its text keeps the strerror)."""
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return True
    text = str(exc)
    return any(os.strerror(code) in text for code in _FULL)


def state_nbytes(obj: Any) -> int:
    """About what torch.save of `obj` takes: every tensor storage once, plus the rest."""
    seen: set[int] = set()
    total = 0

    def walk(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            local = getattr(o, "to_local", None)  # a DTensor: this rank's shard
            storage = (local() if callable(local) else o).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            total += 8

    walk(obj)
    return total + 4096  # the zip's headers, the pickle, the manifest


def disk_full(exc: BaseException, path: Path, needed: int) -> CheckpointError:
    """The one line a full disk gives: the path, the bytes needed and free, the way on."""
    try:
        free = f"{shutil.disk_usage(path.parent if path.parent.exists() else path).free} bytes are free"
    except OSError:
        free = "free space unknown"
    why = "disk quota exceeded" if getattr(exc, "errno", None) == getattr(errno, "EDQUOT", -1) \
        else "no space left on device"
    return CheckpointError(
        f"checkpoint {path}: {why}: it needs about {needed} bytes, {free} there; it was not "
        f"kept and any earlier checkpoint is intact: free space (or move train.run_dir) and "
        f"rerun with --resume")


def write_error(exc: BaseException, path: Path, needed: int, full: bool = False) -> str:
    """The one line of a failed checkpoint write: a full disk (seen in `exc`, or `full`
    as the caller measured it), or the OS's reason."""
    if full or is_disk_full(exc):
        return str(disk_full(exc, path, needed))
    first = (getattr(exc, "strerror", None) or str(exc)).splitlines()[0][:300]
    return f"checkpoint {path}: cannot write it ({first}); check train.run_dir"
