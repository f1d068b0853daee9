"""Checkpoints that survive a crash mid-save and never unpickle arbitrary objects.

    save_checkpoint(ckpt_dir, state, step=120)   # atomic: temp file, fsync, rename
    state, path = load_latest(ckpt_dir)          # newest complete one, weights_only=True

Layout of `checkpoints/`: `ckpt-<step>.pt` files (the newest `keep` are kept) and
`last.pt`, a hard link to the newest. A process killed while writing leaves only a
`.tmp` file behind, which is ignored (and removed by the next save once its writer is
gone), so the previous checkpoint stays loadable.

Reading trusts nothing (issue 7): every zip entry's CRC-32 is checked first (torch.load
itself loads a flipped bit in tensor data silently), then `torch.load(weights_only=True)`
rebuilds only tensors and plain containers, so a crafted pickle cannot run code. A file
that fails either check is reported with its name and skipped for the next newest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.errors import CheckpointError

log = logging.getLogger("disttrain")
CKPT_RE = re.compile(r"^ckpt-(\d+)\.pt$")
TMP_RE = re.compile(r"^\..+\.(\d+)\.tmp$")  # `.<name>.<pid>.tmp` of atomic writes



def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write `obj` to `path` so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)


def save_checkpoint(ckpt_dir: Path, state: dict[str, Any], step: int, keep: int = 2) -> Path:
    """Save `state` as ckpt-<step>.pt, point last.pt at it, prune older ones."""
    remove_stale_tmp(ckpt_dir)
    path = ckpt_dir / f"ckpt-{step:08d}.pt"
    atomic_torch_save(state, path)
    link_tmp = ckpt_dir / f".last.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        link_tmp.unlink()
    try:
        os.link(path, link_tmp)
    except OSError:  # filesystems without hard links: a second atomic copy
        atomic_torch_save(state, link_tmp)
    os.replace(link_tmp, ckpt_dir / "last.pt")
    _fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[keep:]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return path


def remove_stale_tmp(ckpt_dir: Path) -> list[Path]:
    """Delete temp files left by writers that were killed mid-save (their pid is gone)."""
    removed: list[Path] = []
    if not ckpt_dir.is_dir():
        return removed
    for p in ckpt_dir.iterdir():
        m = TMP_RE.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_running(int(m.group(1))):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Numbered checkpoints, newest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def verify_zip(path: Path) -> None:
    """Check that `path` is a complete torch.save zip whose entries match their CRC-32.

    Raises:
        CheckpointError: truncated (no zip directory), or an entry is corrupt.
    """
    try:
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{path}: truncated or not a torch.save file "
                                  f"(no zip directory at its end)")
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except CheckpointError:
        raise
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt (entry {bad} fails its CRC-32 check)")


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify, then load with weights_only=True: tensors and plain containers, no code.

    Raises:
        CheckpointError: the file is truncated, corrupt, holds objects other than
            tensors and plain containers, or is not a disttrain checkpoint.
    """
    verify_zip(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt or not a disttrain checkpoint "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path}: not a disttrain checkpoint (no 'model'/'step' entries)")
    return state


def load_latest(ckpt_dir: Path, map_location: str | torch.device = "cpu"
                ) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads; corrupt ones are reported and skipped.

    Numbered files come first, newest first: a writer killed after renaming
    ckpt-<step>.pt but before re-pointing last.pt leaves last.pt one save behind.
    last.pt is the fallback (a copy where hard links are not supported).
    """
    candidates = list_checkpoints(ckpt_dir)
    last = ckpt_dir / "last.pt"
    if last.exists() and not any(_same_file(last, p) for p in candidates):
        candidates.append(last)
    for path in candidates:
        try:
            return load_checkpoint(path, map_location), path
        except CheckpointError as exc:
            log.warning("warning: skipping checkpoint %s", exc)
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# -- RNG state as plain tensors/ints (loadable with weights_only=True) -------------------
def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
