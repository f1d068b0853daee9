"""The training loop of a correct DDP job, with the usual pitfalls handled for you.

    from disttrain import JobSpec

    from disttrain.distributed import runtime
    from disttrain.train.build import build_trainer
    with runtime.setup() as rt:
        summary = build_trainer(JobSpec(), rt).fit()

It trains any TrainTask (`train/task.py`: the user's model, data, loss or step function
and metrics; the built-in workloads are TrainTasks too) and takes care of: the shard and
order of every rank's data and set_epoch every epoch; gradient accumulation with one
all-reduce per optimizer step; evaluation that counts each held-out sample once, over all
ranks (`train/evaluate.py`); output and files on rank 0 only; atomic checkpoints with RNG
state and exact resume, mid-epoch included (`train/checkpoint.py`); a check that all ranks
ended identical, parameters and buffers. `Trainer.__init__` only stores parts;
`build_trainer` builds them (docs/your-model.md).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrain import envvars
from disttrain.console import EpochTable
from disttrain.distributed.comm_hooks import CommStats
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import no_sync, unwrap
from disttrain.distributed.sync_check import check_in_sync
from disttrain.resilience import heartbeat
from disttrain.resilience.preemption import GracefulStop, write_stop_record
from disttrain.rundir import RunWriter, checkpoint_dir
from disttrain.spec.job import TrainSpec
from disttrain.train.batch import batch_size_of, to_device
from disttrain.train.checkpoint import Checkpointer, TrainState, resume_requested
from disttrain.train.evaluate import Evaluator
from disttrain.train.iterable_loader import IterableLoader
from disttrain.train.loader import SampledLoader
from disttrain.train.memory import MemoryProbe
from disttrain.train.model_parallel import ModelParallel
from disttrain.train.precision import Precision
from disttrain.train.run_info import RunInfo
from disttrain.train.steps import run_step
from disttrain.train.task import TrainTask
from disttrain.train.telemetry import StepTelemetry

__all__ = ["TrainState", "Trainer"]

@dataclass
class Trainer:
    """A built training job. Use `build_trainer(spec, rt)` to make one."""

    rt: Runtime
    cfg: TrainSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task: TrainTask                 # the model's data, loss or step, metrics
    loader: SampledLoader | IterableLoader   # this rank's training batches
    evaluator: Evaluator
    precision: Precision
    info: RunInfo                   # the resolved settings; its run_dir holds the checkpoints
    writer: RunWriter | None = None
    state: TrainState = field(default_factory=TrainState)
    comm: CommStats | None = None   # DDP comm hook's byte counter (builder registers it)
    stop: GracefulStop = field(default_factory=GracefulStop)  # SIGTERM / SIGINT (resilience/preemption.py)
    # the step timer, records, live files, metrics rows and straggler verdict (train/telemetry.py)
    telemetry: StepTelemetry = field(default_factory=StepTelemetry)
    # tensor / pipeline parallel: the mesh, the stage, the step (train/model_parallel.py)
    parallel: ModelParallel | None = None

    # -- the loop -----------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for cfg.epochs (or max_steps), evaluate each epoch, return the summary."""
        t_start = time.perf_counter()
        # Heartbeat for the launcher's stall watchdog: phases from hooks, beats below.
        heartbeat.start(self.rt.rank, self.rt.timeout_s, self.rt.store_address, self.model,
                        self.optimizer)
        self.telemetry.attach(self.rt, self.comm, self.info.run_dir, self.writer)
        self.telemetry.data_ranks = self.data_ranks
        if self.parallel is not None:   # "rank 3 (stage 2 of 2, dp 2 of 2)"; stages compared apart
            self.telemetry.locate(self.parallel.mesh)
        # not under pp: the schedule runs the stage once per micro-batch in one step, and
        # torch's memory tracker refuses a module's second forward ("multiple iterative calls")
        if self.parallel is None or self.parallel.pipe is None:
            self.telemetry.memory = MemoryProbe(self.model, self.optimizer, self.rt.device)
        self.stop.arm(self.rt)
        self.maybe_resume()
        samples_start = self.state.samples
        table = EpochTable(enabled=self.rt.is_rank0)
        table.header(self.info.as_dict())
        train_s, last_eval = 0.0, {}
        while self.state.epoch < self.cfg.epochs and not self._done() and not self.stop.agreed_signum:
            t0, samples0 = time.perf_counter(), self.state.samples
            train_loss, complete = self.train_epoch(table)
            dt = time.perf_counter() - t0
            train_s += dt
            if self.stop.agreed_signum and not complete:  # stopped mid-epoch: no evaluation
                break
            last_eval = self.evaluate()
            sps = (self.state.samples - samples0) * self.data_ranks / max(dt, 1e-9)
            table.row(self.state.epoch, train_loss, last_eval.get("loss", float("nan")),
                      last_eval.get("accuracy", float("nan")), sps)
            if self.writer and last_eval:
                self.writer.log([{"split": "eval", "rank": -1, "epoch": self.state.epoch,
                                  "step": self.state.step, **last_eval}])
            if not complete:  # stopped mid-epoch by max_steps: the epoch is not done
                break
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
            every = self.cfg.checkpoint_every_epochs
            if every and (self.state.epoch % every == 0 or self.state.epoch == self.cfg.epochs):
                self.save()
        run_sps = (self.state.samples - samples_start) * self.data_ranks / train_s if train_s else 0.0
        if self.stopped_by:  # the ranks agreed to stop at this step: one checkpoint to resume from
            self.save()
        return self.finish(last_eval, run_sps, time.perf_counter() - t_start, table)

    def train_epoch(self, table: EpochTable) -> tuple[float, bool]:
        """One pass over this rank's shard: the mean logged loss over all ranks, and whether
        the epoch ran to its end (not cut by max_steps)."""
        cfg, st = self.cfg, self.state
        self.loader.set_epoch(st.epoch)  # a new shuffle each epoch, else every epoch repeats epoch 0's order
        self.loader.skip = st.batch_in_epoch
        sized = not isinstance(self.loader, IterableLoader)
        n_batches = len(self.loader) if sized else None
        self.model.train()
        epoch_losses: list[torch.Tensor] = []
        progress = table.progress(n_batches or 0, st.epoch)
        # (batch, is it the epoch's last): by count for a sized loader, by reading ahead for a stream
        batches = (zip(self.loader, (j + 1 == n_batches for j in itertools.count(st.batch_in_epoch)))
                   if sized else _with_lookahead(self.loader))
        complete = True
        for batch, last in self.telemetry.epoch(batches, st.samples):
            heartbeat.beat(st.step)  # attribute writes only; a thread publishes (docs/resilience.md)
            i = st.batch_in_epoch
            # The last group of an epoch may be short: it still ends in an optimizer step.
            boundary = (i + 1) % cfg.grad_accum == 0 or last
            loss, n = self.train_step(batch, self._micro_weight(i, n_batches), sync=boundary)
            st.batch_in_epoch += 1
            st.samples += n
            if not boundary:
                continue
            self.optimizer_step()
            if st.step % cfg.log_every_steps == 0 or last or self._done():
                self.telemetry.log(st.epoch, st.step, loss, self.current_lr, st.samples)
                epoch_losses.append(loss)
                progress.update(st.batch_in_epoch)
            if cfg.checkpoint_every_steps and st.step % cfg.checkpoint_every_steps == 0:
                self.save()
            if self._done():
                complete = last
                break
            if self.stop.agreed(st.step):  # a signal: all ranks leave after this same step
                complete = last
                break
        progress.close()
        self.telemetry.flush()
        return self._global_mean(epoch_losses), complete

    def _micro_weight(self, i: int, n_batches: int | None) -> float:
        """Weight of micro-batch i's mean loss in its accumulation group: its share of the
        group's samples, so K micro-batches give exactly the gradient of one K-times
        bigger batch, also for the epoch's short last group and short last batch. A stream
        (IterableDataset) has no known length: its micro-batches weigh 1/K each."""
        k = self.cfg.grad_accum
        if k == 1:
            return 1.0
        if n_batches is None:
            return 1.0 / k
        first = i - i % k
        group = sum(self.loader.batch_len(j) for j in range(first, min(first + k, n_batches)))
        return self.loader.batch_len(i) / group

    def train_step(self, batch: Any, weight: float, sync: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch; gradients all-reduced only when `sync`.
        Returns the (detached) loss and the batch's sample count."""
        batch = to_device(batch, self.rt.device)
        timer = self.telemetry.timer
        if self.telemetry.memory is not None:   # the first steps' tensor peak (CPU only)
            self.telemetry.memory.before_micro(batch)
        timer.compute_start()
        with no_sync(self.model, skip=not sync), self.precision.autocast():
            if self.parallel is not None and self.parallel.pipe is not None:
                loss = self.parallel.pipeline_step(batch, weight)   # the schedule's backward
            else:
                loss, _ = run_step(self.task, self.model, batch)
                self.precision.backward(loss * weight if weight != 1.0 else loss)
        timer.compute_end()
        return loss.detach(), batch_size_of(batch)

    def optimizer_step(self) -> None:
        timer = self.telemetry.timer
        timer.optimizer_start()
        if self.parallel is not None:
            self.parallel.before_optimizer_step()
        self.precision.step(self.optimizer)
        # Under DDP the gradients are views into its buckets: zero them in place, which
        # keeps that memory. Elsewhere set_to_none: backward then writes the gradient
        # instead of adding it to zeros (~0.2 ms/step less on the synthetic workload).
        self.optimizer.zero_grad(set_to_none=not isinstance(self.model, DDP))
        if self.comm is not None:
            self.comm.end_step()
        self.scheduler.step()
        timer.optimizer_end()
        self.state.step += 1
        if self.telemetry.memory is not None:
            self.telemetry.memory.after_step(self.state.step)
        if self.state.step == 1:
            self.info.record_first_step(_since_launch())

    def evaluate(self) -> dict[str, float]:
        """Loss and the task's metrics on the whole eval set, over all ranks ({} without one)."""
        self._sync_buffers()
        return self.evaluator.run(self.model, self.state.step)

    def _sync_buffers(self) -> None:
        """Make every rank's buffers (BatchNorm's running statistics) rank 0's before they
        are used or saved. DDP broadcasts rank 0's at the start of each forward, so after
        the last forward of an epoch each rank holds its own; FSDP never syncs them. Either
        way the ranks would evaluate and checkpoint different models. One broadcast per
        buffer, once per epoch; nothing for a model without buffers."""
        if not (self.rt.distributed and self.rt.world_size > 1 and self.info.strategy_effective
                in ("ddp", "fsdp")):
            return
        for buf in unwrap(self.model).buffers():
            dist.broadcast(buf, src=0)

    # -- bookkeeping ----------------------------------------------------------------
    @property
    def data_ranks(self) -> int:
        """Ranks that read different batches (each sample counted once in samples/s)."""
        return self.parallel.dp_size if self.parallel is not None else self.rt.world_size

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _done(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    @property
    def stopped_by(self) -> int:
        """The signal the ranks stopped for before the end of training (0: not stopped; a
        signal agreed on at the very last step changes nothing, the run is complete)."""
        finished = self.state.epoch >= self.cfg.epochs or self._done()
        return 0 if finished else self.stop.agreed_signum

    def _global_mean(self, losses: list[torch.Tensor]) -> float:
        if not losses:
            return float("nan")
        t = torch.stack(losses).float().mean().reshape(1)
        if self.rt.distributed and self.rt.world_size > 1:
            dist.all_reduce(t)
            t /= self.rt.world_size
        return t.item()

    # -- checkpoints (what is saved and how: train/checkpoint.py) ------------------
    @property
    def checkpointer(self) -> Checkpointer:
        return Checkpointer(self.rt, checkpoint_dir(self.info.run_dir), self.model,
                            self.optimizer, self.scheduler, self.precision, loader=self.loader,
                            layout=self.parallel.layout(self.optimizer) if self.parallel else None,
                            save_frozen=self.task.save_frozen)

    def save(self) -> None:
        """A checkpoint of this step: rank 0 writes (atomically) what every rank needs."""
        heartbeat.beat(self.state.step, "checkpoint")
        self._sync_buffers()
        self.checkpointer.save(self.state, write=self.writer is not None)

    def maybe_resume(self) -> None:
        """Continue from the newest checkpoint when asked to, or after a restart."""
        if not resume_requested(self.cfg.resume):
            return
        found = self.checkpointer.restore()
        if found is None:
            self.rt.print0("resume: no checkpoint found, starting from scratch")
            if self.writer:  # a restart before the first save: its records are redone
                self.writer.truncate_after(0)
            return
        self.state, path = found
        if self.writer:
            self.writer.truncate_after(self.state.step)
        self.rt.print0(f"resumed from {path} (epoch {self.state.epoch}, step {self.state.step})")

    def finish(self, last_eval: dict[str, float], samples_per_s: float, wall_s: float,
               table: EpochTable) -> dict[str, Any]:
        """Compare the ranks' state (parameters and buffers) and write summary.json / loss.png."""
        heartbeat.beat(self.state.step, "finish")
        self._sync_buffers()
        # The whole state_dict: parameters and buffers (BatchNorm statistics included);
        # names the rank and tensor when they differ.
        sync = (self.parallel.check_in_sync() if self.parallel is not None
                else check_in_sync(self.model, "state"))
        if not sync.in_sync:
            self.rt.print0(f"warning: {sync.describe()}")
        final = self.writer.last_train_loss() if self.writer else None
        summary = {
            **self.info.as_dict(),
            "epochs": self.state.epoch, "steps": self.state.step, "final_loss": final,
            "test_loss": last_eval.get("loss"), "test_accuracy": last_eval.get("accuracy"),
            "eval": last_eval, "samples_per_s": samples_per_s,
            "params_sha256": sync.digests[self.rt.rank], "params_in_sync": sync.in_sync,
            "params_sha256_per_rank": sync.digests, "wall_s": round(wall_s, 3),
            **({} if sync.in_sync else {"params_divergence": sync.as_dict()}),
            **({"params_check": sync.scope} if sync.scope else {}),  # tp/pp: what was compared
            **(self.comm.summary() if self.comm is not None else {}),
            **self.telemetry.finish(samples_per_s),   # `ranks`, `straggler`
        }
        if self.task.on_end is not None and not self.stopped_by:  # what lasts (train/task.py)
            out = self.cfg.output_dir
            summary.update(self.task.on_end(self.model, self.rt, out and Path(out), last_eval))
        ckpt = checkpoint_dir(self.info.run_dir) / "last.pt"
        if self.stopped_by:  # resumable: `disttrain run` reads the record (resilience/preemption.py)
            summary["stopped"] = {"signal": self.stopped_by, "checkpoint": str(ckpt)}
        if self.writer:
            self.writer.finish(summary)
            if self.stopped_by:
                write_stop_record(self.info.run_dir, self.stopped_by, self.state.step,
                                  self.state.epoch, ckpt)
        table.footer(summary)
        if summary["straggler"]:
            self.rt.print0(summary["straggler"]["message"])
        self.telemetry.close()
        heartbeat.stop()  # training is over: what the process does next is not watched
        self.stop.disarm()
        return summary


def _since_launch() -> float | None:
    t0 = envvars.launch_t0()
    return round(time.time() - t0, 3) if t0 is not None else None


def _with_lookahead(loader: IterableLoader) -> Iterator[tuple[Any, bool]]:
    """(batch, is_last) from a stream whose length is unknown: one batch is read ahead, so
    the epoch's last micro-batch still ends in an optimizer step."""
    it = iter(loader)
    current = next(it, _END)
    while current is not _END:
        following = next(it, _END)
        yield current, following is _END
        current = following


_END = object()
