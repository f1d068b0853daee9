"""One owner for a rank's step telemetry: timer, records, live files, metrics rows, straggler.

    telemetry = StepTelemetry()
    telemetry.attach(rt, comm, run_dir, writer)          # once, when fit() starts
    for batch in telemetry.epoch(batches, state.samples):    # each epoch: the timed batches
        ...  telemetry.timer.compute_start() ... (the phase boundaries: train/step_timing.py)
        if logging_step:
            telemetry.log(epoch, step, loss, lr, state.samples)   # one record, the live file
    telemetry.flush()                                    # each epoch's end: one all_gather
    summary.update(telemetry.finish(samples_per_s))      # summary.json's `ranks`, `straggler`

In the shape of torchtitan's `MetricsProcessor` (torchtitan/components/metrics.py): the
training loop hands it what it knows at a few points and it decides what is written
where. What it owns:

- the per-rank records (`StepRecord`: named fields) of each logging interval: the loss
  (a detached tensor, read at the flush), samples/s, the learning rate and the phase means
  (`train/phases.py`'s `StepTimes`);
- `live/rank-<R>.json` at every logging interval (`LiveStatus`, no collective), for
  `disttrain top`;
- the flush: every rank's records gathered to rank 0 in one collective every
  `FLUSH_RECORDS` records and at each epoch's end, written as metrics.jsonl train rows
  (`rundir.RunWriter`, which also hands them to TensorBoard: `monitor/tensorboard.py`);
- the straggler verdict's inputs: each rank's identity (rank, host, device, HAMi limit,
  under tp / pp its place in the mesh (`locate`: the verdict compares a pipeline stage's
  ranks with each other only, and every view says "stage 2 of 2"), gathered once) beside
  its phase means, judged per interval by rank 0
  (`train/straggler.py`'s `StragglerWatch`: said once when it lasts) and over the run at
  the end (summary.json's `ranks`, `straggler`; also `live/straggler.json`);
- a test-only slowdown of this rank, installed once (`resilience/faults.py`'s `Slowdown`).

Nothing is communicated per step; what can be decided once (the identity, whether a
slowdown applies, whether the live files can be written) is decided in `attach`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from disttrain import envvars
from disttrain.resilience.faults import Slowdown
from disttrain.rundir import LIVE, LIVE_STRAGGLER, RunWriter
from disttrain.train.phases import STEP_KEYS, StepTimes
from disttrain.train.step_timing import StepTimer
from disttrain.train.straggler import StragglerWatch, find_straggler

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from disttrain.distributed.comm_hooks import CommStats
    from disttrain.distributed.runtime import Runtime

__all__ = ["FLUSH_RECORDS", "LiveStatus", "StepRecord", "StepTelemetry", "mesh_place", "rank_identity"]

FLUSH_RECORDS = 50  # gather logged losses to rank 0 every this many records (one collective)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One logging interval of this rank, as the flush writes it."""

    epoch: int
    step: int
    loss: torch.Tensor          # detached, on the device: read at the flush, all at once
    samples_per_s: float        # the job's samples/s over the interval
    lr: float
    times: StepTimes            # this rank's phase means over the interval


def rank_identity(rt: Runtime) -> dict[str, Any]:
    """This rank's rank, host and device, and the HAMi limit it runs under when the
    container shows one (`envvars.hami_limits`: docs/cluster.md)."""
    ident: dict[str, Any] = {"rank": rt.rank, "host": socket.gethostname(), "device": str(rt.device)}
    limit = envvars.hami_limits().describe(rt.device.index or 0)
    if limit:
        ident["limit"] = limit
    return ident


def mesh_place(mesh: Any) -> dict[str, list[int]]:
    """This rank's place in a DeviceMesh: `{dim: [index, size]}` for each dimension larger
    than 1 (`distributed/mesh.py`'s pp, dp_replicate, dp_shard, tp), as the identity, the
    live files and summary.json's `ranks` carry it (`straggler.place_label` reads it)."""
    names = mesh.mesh_dim_names or ()
    return {name: [int(mesh.get_local_rank(name)), int(mesh.size(i))]
            for i, name in enumerate(names) if mesh.size(i) > 1}


class StepTelemetry:
    """This rank's step telemetry, from `attach` to `finish` (see the module docstring)."""

    def __init__(self, threshold: float = 1.5) -> None:
        self.timer = StepTimer()
        self.watch = StragglerWatch(threshold)
        self.records: list[StepRecord] = []
        self._rt: Runtime | None = None
        self._writer: RunWriter | None = None
        self._live: LiveStatus | None = None
        self._ident: dict[str, Any] = {}
        self._idents: list[dict[str, Any]] | None = None   # every rank's (the first flush)
        self._slow: Slowdown | None = None
        self._t_log = 0.0
        self._samples_log = 0
        # what the rank's memory really was (train/memory.py's MemoryProbe, set by the Trainer)
        self.memory: Any = None
        # ranks reading different batches (samples/s); None: all. tp/pp: the data-parallel ones
        self.data_ranks: int | None = None

    # -- the loop's calls ------------------------------------------------------------------
    def attach(self, rt: Runtime, comm: CommStats | None, run_dir: Path,
               writer: RunWriter | None) -> None:
        """Start: the timer on the DDP hook (CUDA events on a GPU), this rank's identity,
        its live file, and a slowdown `envvars.FAULT` asks of it (testing only)."""
        self._rt, self._writer = rt, writer
        self.timer.attach(rt, comm)
        self._ident = rank_identity(rt)
        self._live = LiveStatus(rt, run_dir, self._ident)
        self._slow = Slowdown.install(self.timer, rt.rank)

    def locate(self, mesh: Any) -> None:
        """This rank's place in the tp / pp mesh (`mesh_place`), into its identity: the
        live file's next write and the first flush's gather carry it, so call it before
        the first logging step (the Trainer: right after `attach`)."""
        place = mesh_place(mesh)
        if place:
            self._ident["mesh"] = place   # the live file holds the same dict

    def epoch(self, batches: Iterable[Any], samples: int) -> Iterator[Any]:
        """An epoch's batches, timed (the data phase: the loader's next()); its first step
        and logging interval begin now. `samples`: the samples trained so far."""
        self._t_log, self._samples_log = time.perf_counter(), samples
        if self._slow is not None:
            batches = self._slow.batches(batches)
        self.timer.start()
        return self.timer.timed(batches)

    def log(self, epoch: int, step: int, loss: torch.Tensor, lr: float, samples: int) -> None:
        """A logging step: the interval's record (samples/s from `samples`, the samples
        trained so far), this rank's live file, and a flush every `FLUSH_RECORDS`."""
        now = time.perf_counter()
        assert self._rt is not None, "attach() first"
        ranks = self.data_ranks or self._rt.world_size
        sps = (samples - self._samples_log) * ranks / max(now - self._t_log, 1e-9)
        self._t_log, self._samples_log = now, samples
        times = self.timer.interval()
        self.records.append(StepRecord(epoch, step, loss, sps, lr, times))
        if self._live is not None:
            if self.memory is not None:
                self._live.extra = self.memory.live_fields()
            self._live.write(epoch, step, loss.item(), sps, times)
        if len(self.records) >= FLUSH_RECORDS:
            self.flush()

    def flush(self) -> None:
        """Gather every rank's records to rank 0 in one collective and write them as
        metrics.jsonl train rows; rank 0 then looks for a straggler, interval by interval
        (`train/straggler.py`), and says so once when one lasts."""
        rt, records = self._rt, self.records
        if not records or rt is None:
            return
        if self._idents is None:  # once per run: who each rank is, for the verdict's message
            self._idents = rt.all_gather_object(self._ident)
        loss = torch.stack([r.loss.float() for r in records]).reshape(-1, 1)
        extra = torch.tensor([(r.samples_per_s, *astuple(r.times)) for r in records], dtype=loss.dtype)
        local = torch.cat([loss, extra.to(loss.device)], dim=1)   # [loss, sps, *STEP_KEYS] per record
        if rt.distributed and rt.world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(rt.world_size)]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        if self._writer is not None:
            self._write(records, [g.tolist() for g in gathered])
        records.clear()

    def finish(self, samples_per_s: float) -> dict[str, Any]:
        """summary.json's `ranks` (each rank's whole-run phase means, one gather) and
        `straggler` (train/straggler.py), also in live/straggler.json when there is one."""
        assert self._rt is not None, "attach() first"
        mine = {**self._ident, "samples_per_s": round(samples_per_s, 1),
                **self.timer.run_means().as_dict(),
                **(self.memory.fields() if self.memory is not None else {})}
        ranks = self._rt.all_gather_object(mine)
        # A run of one logging interval has only its first steps, where a rank's lazy
        # initialisation can weigh more than the others': no verdict on those (every rank
        # timed as many intervals, so all of them decide alike).
        verdict = find_straggler(ranks, self.watch.threshold) if self.timer.steady else None
        if verdict is not None and self._live is not None and self._rt.is_rank0:
            self._live.write_straggler(verdict)
        return {"ranks": ranks, "straggler": verdict}

    def close(self) -> None:
        """The run is over: each live file's last write says so."""
        if self._live is not None:
            self._live.done()

    # -- rank 0's writing ------------------------------------------------------------------
    def _write(self, records: list[StepRecord], per_rank: list[list[list[float]]]) -> None:
        assert self._writer is not None and self._idents is not None and self._rt is not None
        rows = []
        for rank, values in enumerate(per_rank):
            for r, (loss_v, sps, *times) in zip(records, values):
                rows.append({"split": "train", "rank": rank, "epoch": r.epoch, "step": r.step,
                             "loss": loss_v, "lr": r.lr, "samples_per_s": round(sps, 1),
                             **{k: round(v, 3) for k, v in zip(STEP_KEYS, times)}})
        self._writer.log(rows)
        for j in range(len(records)):
            entries = [{**self._idents[rank], **dict(zip(STEP_KEYS, values[j][2:]))}
                       for rank, values in enumerate(per_rank)]
            verdict = self.watch.window(entries)
            if verdict is not None:
                self._rt.print0(verdict["message"])
                if self._live is not None:
                    self._live.write_straggler(verdict)


class LiveStatus:
    """`RUN_DIR/live/rank-<R>.json`: this rank's latest interval, replaced atomically.

    A view for `disttrain top`, never a reason to stop training: a run directory this rank
    cannot write (read-only, full) turns the live files off with one warning."""

    def __init__(self, rt: Runtime, run_dir: Path, ident: dict[str, Any] | None = None) -> None:
        self.rank, self.world_size = rt.rank, rt.world_size
        self.ident = ident if ident is not None else rank_identity(rt)
        self.dir = Path(run_dir) / LIVE
        self.path = self.dir / f"rank-{rt.rank}.json"
        self._last: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}   # more figures for the file (memory: train/memory.py)
        self.enabled = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if rt.is_rank0:   # an earlier attempt's verdict, and ranks this job does not have
                stale = [self.dir / LIVE_STRAGGLER]
                stale += [p for p in self.dir.glob("rank-*.json")
                          if not p.stem[5:].isdigit() or int(p.stem[5:]) >= rt.world_size]
                for path in stale:
                    path.unlink(missing_ok=True)
        except OSError as e:
            self._off(e)

    def write(self, epoch: int, step: int, loss: float, samples_per_s: float, times: StepTimes,
              done: bool = False) -> None:
        rec = {"rank": self.rank, "world_size": self.world_size, "host": self.ident["host"],
               "pid": os.getpid(), "device": self.ident["device"], "epoch": epoch, "step": step,
               "loss": loss, "samples_per_s": round(samples_per_s, 1), **times.as_dict()}
        for key in ("limit", "mesh"):   # the HAMi limit; the place in a tp / pp mesh
            if key in self.ident:
                rec[key] = self.ident[key]
        rec.update(self.extra)   # the memory figures (train/memory.py), when measured
        self._last = rec
        self._replace(self.path, {**rec, "time": round(time.time(), 3), "done": done})

    def done(self) -> None:
        """The last write of the run: the latest figures again, `done` true."""
        if self._last:
            self._replace(self.path, {**self._last, "time": round(time.time(), 3), "done": True})

    def write_straggler(self, verdict: dict[str, Any]) -> None:
        self._replace(self.dir / LIVE_STRAGGLER, verdict)

    def _replace(self, path: Path, obj: dict[str, Any]) -> None:
        if not self.enabled:
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(obj), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            self._off(e)

    def _off(self, error: OSError) -> None:
        self.enabled = False
        print(f"warning: rank {self.rank}: live status files off ({self.dir}: {error}); "
              f"training goes on", file=sys.stderr, flush=True)
