"""Checkpoints of a training run: atomic .pt files, FSDP's sharded folders, exact resume.

    ckpt = Checkpointer(rt, checkpoint_dir(run_dir), model, optimizer, scheduler, precision)
    ckpt.save(state, write=rt.is_rank0)          # a collective: every rank calls it
    found = ckpt.restore()                       # (TrainState, path) or None; all ranks agree
    state, path = load_latest(ckpt_dir)          # the file layer alone: newest that loads

Layout of `checkpoints/`: `ckpt-<step>.pt` files (the newest `KEEP` = 2: the newest and
one to fall back to), each with its integrity record `ckpt-<step>.manifest.json` (sizes
and sha256 of its files, written last: `train/ckpt_integrity.py`), and `last.pt`, a hard
link to the newest. A process killed while writing leaves only a `.tmp` file behind,
which is ignored (and removed by the next save once its writer is gone), so the previous
checkpoint stays loadable; a full disk removes what the save wrote and says so. Under
FSDP every rank also writes its shards of model and optimizer to `dcp-<step>/`
(`train/ckpt_sharded.py`), which the .pt file names and the manifest records; the .pt
still holds the consolidated model weights for plain torch users.

Reading trusts nothing: a checkpoint may come from a crashed writer, a disk that flipped
a bit, or someone else. Its files are checked against the manifest first (a checkpoint of
an older disttrain has none), then every zip entry's CRC-32 (torch.load itself loads a
flipped bit in tensor data silently), then `torch.load(weights_only=True)` rebuilds only
tensors and plain containers, so a crafted pickle cannot run code. A checkpoint that fails
a check is reported with the file's name and what is wrong, and skipped for the next newest.

Resume is exact: the .pt holds the position (`TrainState`: epoch, batch in the epoch,
optimizer step, samples), the scheduler and loss scaler, and every rank's RNG states, so
a resumed run takes the same steps as one that never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from disttrain import envvars
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import is_fsdp, unwrap
from disttrain.errors import CheckpointError, IncompatibleCheckpoint
from disttrain.train.ckpt_compat import resume_fix, state_dict_mismatch
from disttrain.train.ckpt_integrity import (
    Digest,
    HashingWriter,
    atomic_write,
    file_digest,
    is_disk_full,
    manifest_path,
    state_nbytes,
    verify_manifest,
    write_error,
    write_manifest,
)
from disttrain.train.ckpt_sharded import ShardedLayout, dcp_name, load_sharded, save_sharded
from disttrain.train.ckpt_trainable import (
    FROZEN_LEFT_OUT,
    frozen_numel,
    load_trainable,
    trainable_state,
)
from disttrain.train.precision import Precision

log = logging.getLogger("disttrain")
CKPT_RE = re.compile(r"^ckpt-(\d+)\.pt$")
DCP_RE = re.compile(r"^dcp-(\d+)$")
# Checkpoints kept: the newest, and one to fall back to when the newest is found damaged.
KEEP = 2
TMP_RE = re.compile(r"^\..+\.(\d+)\.tmp$")  # `.<name>.<pid>.tmp` of atomic writes


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_torch_save(obj: Any, path: Path) -> Digest:
    """Write `obj` to `path` so that readers see the old file or the new one, never half.

    The bytes are hashed as torch.save writes them, and the temp file is read back and
    compared before it is renamed into place: what the manifest records is what is on
    disk. Returns the file's (bytes, sha256).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    written: list[Digest] = []

    def write(f: Any) -> None:
        writer = HashingWriter(f)
        try:
            torch.save(obj, writer)
        except Exception:
            if writer.error is not None:
                raise writer.error from None
            raise
        written.append(writer.digest())

    def check(tmp: Path) -> None:
        if file_digest(tmp) != written[0]:
            raise CheckpointError(f"{path}: the bytes read back after writing differ from "
                                  f"those written; check the disk or filesystem of train.run_dir")

    atomic_write(path, write, check)
    _fsync_dir(path.parent)
    return written[0]


def save_checkpoint(ckpt_dir: Path, state: dict[str, Any], step: int, keep: int = KEEP,
                    files: dict[str, Digest] | None = None) -> Path:
    """Save `state` as ckpt-<step>.pt with its manifest, point last.pt at it, prune.

    Args:
        files: more files the checkpoint is made of (FSDP's `dcp-<step>/` folder), named
            relative to `ckpt_dir`, for the manifest.

    Older checkpoints are pruned only once this one is complete, verified and recorded.

    Raises:
        CheckpointError: the disk is full (the path, the bytes needed and free) or the
            file cannot be written; nothing of this checkpoint is left behind then.
    """
    path = ckpt_dir / f"ckpt-{step:08d}.pt"
    recorded, existed = False, path.exists()
    try:
        remove_stale_tmp(ckpt_dir)
        with contextlib.suppress(FileNotFoundError):  # a re-save of this step: the old
            manifest_path(path).unlink()               # record must not name the new file
        digest = atomic_torch_save(state, path)
        write_manifest(path, {path.name: digest, **(files or {})})
        recorded = True
        _fsync_dir(ckpt_dir)
        _point_last(ckpt_dir, path)
    except OSError as exc:
        if recorded:  # complete and recorded: kept, the newest that loads; last.pt lags
            raise CheckpointError(f"checkpoint {path}: written, but last.pt could not be "
                                  f"re-pointed at it ({exc.strerror or exc}); check "
                                  f"train.run_dir") from None
        if not existed:
            for p in (path, manifest_path(path)):
                with contextlib.suppress(OSError):
                    p.unlink()
        raise CheckpointError(write_error(exc, path, state_nbytes(state))) from None
    prune(ckpt_dir, step, keep)
    return path


def _point_last(ckpt_dir: Path, path: Path) -> None:
    link_tmp = ckpt_dir / f".last.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        link_tmp.unlink()
    try:
        os.link(path, link_tmp)
    except OSError as exc:  # filesystems without hard links: a copy
        if is_disk_full(exc):
            raise
        shutil.copyfile(path, link_tmp)
    os.replace(link_tmp, ckpt_dir / "last.pt")
    _fsync_dir(ckpt_dir)


def prune(ckpt_dir: Path, step: int, keep: int = KEEP) -> None:
    """Keep the newest `keep` checkpoints up to `step` (with their manifests and DCP
    folders). Those newer than `step` are dropped too: the run resumed from before them
    because the newest was damaged, and they would shadow this one at the next resume."""
    ckpts = list_checkpoints(ckpt_dir)
    kept = [p for p in ckpts if _step_of(p) <= step][:keep]
    for old in ckpts:
        if old not in kept:
            for p in (old, manifest_path(old)):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
    kept_dcp = {dcp_name(_step_of(p)) for p in kept}
    for folder in ckpt_dir.glob("dcp-*"):
        if DCP_RE.match(folder.name) and folder.name not in kept_dcp and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
    for folder in ckpt_dir.glob(".dcp-*.tmp"):  # a sharded save killed midway (none is running:
        shutil.rmtree(folder, ignore_errors=True)  # this one's folder has its final name)


def _step_of(path: Path) -> int:
    m = CKPT_RE.match(path.name)
    assert m is not None, path
    return int(m.group(1))


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

    Every file the manifest names (the .pt, FSDP's folder) is checked against its size and
    sha256 first; a checkpoint without one (an older disttrain) gets the zip checks only.

    Raises:
        CheckpointError: a file is missing, truncated, corrupt, holds objects other than
            tensors and plain containers, or is not a disttrain checkpoint.
    """
    verify_manifest(path)
    verify_zip(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt or not a disttrain checkpoint "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path}: not a disttrain checkpoint (no 'model'/'step' entries)")
    return state


def load_latest(ckpt_dir: Path, map_location: str | torch.device = "cpu", report: bool = True
                ) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads; corrupt ones are reported (one warning each,
    where `report`: rank 0 of a job) and skipped.

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
            log.log(logging.WARNING if report else logging.DEBUG, "warning: skipping checkpoint %s", exc)
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


# -- a training run's state: what is saved, and the resume policy -------------------------
@dataclass
class TrainState:
    """Where training is: what a checkpoint must restore for an exact resume."""

    epoch: int = 0            # current epoch (0-based)
    batch_in_epoch: int = 0   # micro-batches of this epoch already consumed
    step: int = 0             # optimizer steps taken
    samples: int = 0          # samples this rank processed (for throughput)


def resume_requested(resume: bool) -> bool:
    """Continue from the newest checkpoint: asked for (`--resume`), or torchrun restarted
    the workers after a failure (`--max-restarts`), when starting over would redo the
    steps already taken and write them twice to metrics.jsonl."""
    return resume or envvars.restart_count() > 0


@dataclass
class Checkpointer:
    """Saves and restores one run's model, optimizer, scheduler, scaler and position."""

    rt: Runtime
    ckpt_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    # this rank's loader: a stream (IterableDataset) with state_dict() saves its position
    loader: Any = None
    # tensor / pipeline parallel: their DCP layout (train/model_parallel.py); FSDP's is built in
    layout: ShardedLayout | None = None
    # False: frozen parameters (a LoRA base the task reloads) are left out (train/ckpt_trainable.py)
    save_frozen: bool = True

    def _loader_state(self) -> Any:
        fn = getattr(self.loader, "state_dict", None)
        return fn() if callable(fn) else None

    def state_dict(self, state: TrainState, sharded: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the .pt file holds; `sharded` (FSDP) replaces model/optimizer by a DCP
        folder reference and the consolidated weights."""
        module = unwrap(self.model)
        weights = sharded if sharded is not None else {
            "model": module.state_dict() if self.save_frozen else trainable_state(module),
            "optimizer": self.optimizer.state_dict()}
        if not self.save_frozen:
            weights = {**weights, FROZEN_LEFT_OUT: frozen_numel(module)}
        scaler = self.precision.scaler
        return {
            "format": 1, **weights, "scheduler": self.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler else None,
            "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch, "step": state.step,
            "samples": state.samples, "world_size": self.rt.world_size,
        }

    def save(self, state: TrainState, write: bool) -> None:
        """A collective: RNG states come from all ranks, FSDP shards from each; the rank
        with `write` (rank 0) writes the .pt file atomically.

        Raises:
            CheckpointError: on every rank alike, when the save failed on any (a full
                disk: the path, the bytes needed and free); the previous checkpoint is
                left complete. The closing all-gather that keeps readers out until the
                file is complete carries each rank's verdict, so no rank waits for a
                collective timeout to learn that the writer failed.
        """
        rngs = self.rt.all_gather_object(rng_state())
        data_states = None
        if _stateful(self.loader):
            data_states = self.rt.all_gather_object(self._loader_state())
        error: str | None = None
        sharded, files = None, {}
        if is_fsdp(self.model) or self.layout is not None:  # every rank writes its shards
            try:
                sharded, files = save_sharded(self.ckpt_dir, state.step, self.model,
                                              self.optimizer, rank0=self.rt.is_rank0,
                                              layout=self.layout, save_frozen=self.save_frozen)
            except CheckpointError as exc:
                error = str(exc)
        if write and error is None:
            saved = self.state_dict(state, sharded)
            saved["rng"] = rngs
            if data_states is not None:
                saved["data"] = data_states   # one per rank: each stream is its own shard
            try:
                save_checkpoint(self.ckpt_dir, saved, state.step, files=files)
            except CheckpointError as exc:
                error = str(exc)
                if sharded is not None:  # its folder without the .pt that names it
                    shutil.rmtree(self.ckpt_dir / sharded["dcp"], ignore_errors=True)
        failed = [e for e in self.rt.all_gather_object(error) if e]
        if failed:
            raise CheckpointError(failed[0])

    def restore(self) -> tuple[TrainState, Path] | None:
        """Load the newest checkpoint into the parts; its state and path, or None.

        Raises:
            CheckpointError: the ranks found different checkpoints (a run dir that the
                nodes do not share, e.g. each pod's own disk, would silently
                desynchronise them), or one saved at another world size (the data order
                would differ).
            IncompatibleCheckpoint: one saved from another model (keys or shapes differ,
                named) or optimizer (train/ckpt_compat.py).
        """
        found = load_latest(self.ckpt_dir, report=self.rt.is_rank0)
        steps = self.rt.all_gather_object(None if found is None else found[0]["step"])
        if len(set(steps)) > 1:
            raise CheckpointError(
                f"resume: the ranks found different checkpoints in {self.ckpt_dir} "
                f"(step by rank: {steps}); put train.run_dir on a volume that every node shares")
        if found is None:
            return None
        ckpt, path = found
        fix = resume_fix(str(self.ckpt_dir.parent))
        left_out = FROZEN_LEFT_OUT in ckpt   # saved without its frozen base: loaded onto ours
        if not ckpt.get("dcp") and not left_out:   # before torch's error, from our frames
            problem = state_dict_mismatch(unwrap(self.model).state_dict(), ckpt["model"])
            if problem is not None:
                raise IncompatibleCheckpoint(
                    f"resume: {path} does not fit this model: {problem}; "
                    f"{resume_fix(str(self.ckpt_dir.parent))}")
        if ckpt.get("world_size") != self.rt.world_size:
            raise CheckpointError(f"{path}: saved with world size {ckpt.get('world_size')}, "
                                  f"this job has {self.rt.world_size}; the data order would differ")
        if ckpt.get("dcp"):  # FSDP: every rank loads its shards of model and optimizer
            load_sharded(path.parent / ckpt["dcp"], self.model, self.optimizer, self.layout,
                         save_frozen=not left_out, fix=fix)
        else:
            if left_out:   # strict about the trainable keys; the frozen ones keep their values
                load_trainable(unwrap(self.model), ckpt["model"], str(path), fix)
            else:
                unwrap(self.model).load_state_dict(ckpt["model"])
            try:
                self.optimizer.load_state_dict(ckpt["optimizer"])
            except (ValueError, KeyError) as exc:  # same weights, another optimizer's state
                raise IncompatibleCheckpoint(
                    f"resume: {path}: its optimizer state does not fit this optimizer "
                    f"({str(exc).splitlines()[0][:200]}); "
                    f"{resume_fix(str(self.ckpt_dir.parent))}") from None
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.precision.scaler and ckpt.get("scaler"):
            self.precision.scaler.load_state_dict(ckpt["scaler"])
        rngs = ckpt.get("rng") or []
        if self.rt.rank < len(rngs):
            set_rng_state(rngs[self.rt.rank])
        data_states = ckpt.get("data") or []
        if _stateful(self.loader) and self.rt.rank < len(data_states):
            self.loader.load_state_dict(data_states[self.rt.rank])
        state = TrainState(ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["step"],
                           ckpt.get("samples", 0))
        return state, path



def _stateful(loader: Any) -> bool:
    """A loader whose position is its own state (IterableLoader over a stream with
    state_dict() / load_state_dict()); the others resume from the batch counter."""
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))
