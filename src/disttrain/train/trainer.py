"""The training loop of a correct DDP job, with the usual pitfalls handled for you.

    from disttrain import JobSpec

    from disttrain.distributed import runtime
    from disttrain.train.build import build_trainer
    with runtime.setup() as rt:
        summary = build_trainer(JobSpec(), rt).fit()

What it takes care of: DistributedSampler.set_epoch every epoch; evaluation on the
held-out split with loss/accuracy summed over all ranks (not rank 0's shard); output and
files on rank 0 only; gradient accumulation with one all-reduce per optimizer step;
atomic checkpoints with RNG state and exact resume (`train/checkpoint.py`); a
parameter-hash check that all ranks ended identical. `Trainer.__init__` only stores
parts; `build_trainer` builds them. Evaluation scores a classifier (`classification_sums`),
as every built-in workload is one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrain import envvars
from disttrain.console import EpochTable
from disttrain.distributed.comm_hooks import CommStats
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import eval_module, no_sync
from disttrain.distributed.sync_check import check_in_sync
from disttrain.resilience import heartbeat
from disttrain.rundir import RunWriter, checkpoint_dir
from disttrain.spec.job import TrainSpec
from disttrain.train.checkpoint import Checkpointer, TrainState, resume_requested
from disttrain.train.loader import ShardedLoader, eval_shard
from disttrain.train.precision import Precision
from disttrain.train.run_info import RunInfo

__all__ = ["TrainState", "Trainer", "classification_sums"]

FLUSH_RECORDS = 50  # gather logged losses to rank 0 every this many records (one collective)


@dataclass
class Trainer:
    """A built training job. Use `build_trainer(spec, rt)` to make one."""

    rt: Runtime
    cfg: TrainSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: ShardedLoader
    test_x: torch.Tensor
    test_y: torch.Tensor
    precision: Precision
    info: RunInfo                   # the resolved settings; its run_dir holds the checkpoints
    writer: RunWriter | None = None
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    state: TrainState = field(default_factory=TrainState)
    comm: CommStats | None = None   # DDP comm hook's byte counter (builder registers it)
    _records: list[tuple[int, int, torch.Tensor, float, float]] = field(default_factory=list)

    # -- the loop -----------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for cfg.epochs (or max_steps), evaluate each epoch, return the summary."""
        t_start = time.perf_counter()
        # Heartbeat for the launcher's stall watchdog: phases from hooks, beats below.
        heartbeat.start(self.rt.rank, self.rt.timeout_s, self.rt.store_address, self.model,
                        self.optimizer)
        self.maybe_resume()
        samples_start = self.state.samples
        table = EpochTable(enabled=self.rt.is_rank0)
        table.header(self.info.as_dict())
        train_s, last_eval = 0.0, (float("nan"), float("nan"))
        while self.state.epoch < self.cfg.epochs and not self._done():
            t0, samples0 = time.perf_counter(), self.state.samples
            train_loss = self.train_epoch(table)
            dt = time.perf_counter() - t0
            train_s += dt
            complete = self.state.batch_in_epoch >= len(self.loader)
            last_eval = self.evaluate()
            sps = (self.state.samples - samples0) * self.rt.world_size / max(dt, 1e-9)
            table.row(self.state.epoch, train_loss, *last_eval, sps)
            if self.writer:
                self.writer.log([{"split": "eval", "rank": -1, "epoch": self.state.epoch,
                                  "step": self.state.step, "loss": last_eval[0],
                                  "accuracy": last_eval[1]}])
            if not complete:  # stopped mid-epoch by max_steps: the epoch is not done
                break
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
            every = self.cfg.checkpoint_every_epochs
            if every and (self.state.epoch % every == 0 or self.state.epoch == self.cfg.epochs):
                self.save()
        run_sps = (self.state.samples - samples_start) * self.rt.world_size / train_s if train_s else 0.0
        return self.finish(last_eval, run_sps, time.perf_counter() - t_start, table)

    def train_epoch(self, table: EpochTable) -> float:
        """One pass over this rank's shard; returns the mean logged loss over all ranks."""
        cfg, st = self.cfg, self.state
        self.loader.set_epoch(st.epoch)  # a new shuffle each epoch, else every epoch repeats epoch 0's order
        self.loader.skip = st.batch_in_epoch
        n_batches = len(self.loader)
        self.model.train()
        epoch_losses: list[torch.Tensor] = []
        t_log, samples_log = time.perf_counter(), 0
        progress = table.progress(n_batches, st.epoch)
        for x, y in self.loader:
            heartbeat.beat(st.step)  # attribute writes only; a thread publishes (docs/resilience.md)
            i = st.batch_in_epoch
            # The last group of an epoch may be short: it still ends in an optimizer step.
            boundary = (i + 1) % cfg.grad_accum == 0 or i + 1 == n_batches
            loss = self.train_step(x, y, self._micro_weight(i, n_batches), sync=boundary)
            st.batch_in_epoch += 1
            st.samples += len(x)
            samples_log += len(x)
            if not boundary:
                continue
            self.optimizer_step()
            if st.step % cfg.log_every_steps == 0 or i + 1 == n_batches or self._done():
                now = time.perf_counter()
                sps = samples_log * self.rt.world_size / max(now - t_log, 1e-9)
                t_log, samples_log = now, 0
                self._records.append((st.epoch, st.step, loss, sps, self.current_lr))
                epoch_losses.append(loss)
                progress.update(st.batch_in_epoch)
                if len(self._records) >= FLUSH_RECORDS:
                    self.flush_records()
            if cfg.checkpoint_every_steps and st.step % cfg.checkpoint_every_steps == 0:
                self.save()
            if self._done():
                break
        progress.close()
        self.flush_records()
        return self._global_mean(epoch_losses)

    def _micro_weight(self, i: int, n_batches: int) -> float:
        """Weight of micro-batch i's mean loss in its accumulation group: its share of the
        group's samples, so K micro-batches give exactly the gradient of one K-times
        bigger batch, also for the epoch's short last group and short last batch."""
        k = self.cfg.grad_accum
        if k == 1:
            return 1.0
        first = i - i % k
        group = sum(self.loader.batch_len(j) for j in range(first, min(first + k, n_batches)))
        return self.loader.batch_len(i) / group

    def train_step(self, x: torch.Tensor, y: torch.Tensor, weight: float, sync: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients all-reduced only when `sync`."""
        dev = self.rt.device
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with no_sync(self.model, skip=not sync), self.precision.autocast():
            loss = self.loss_fn(self.model(x), y)
            self.precision.backward(loss * weight if weight != 1.0 else loss)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)
        # Under DDP the gradients are views into its buckets: zero them in place, which
        # keeps that memory. Elsewhere set_to_none: backward then writes the gradient
        # instead of adding it to zeros (~0.2 ms/step less on the synthetic workload).
        self.optimizer.zero_grad(set_to_none=not isinstance(self.model, DDP))
        if self.comm is not None:
            self.comm.end_step()
        self.scheduler.step()
        self.state.step += 1
        if self.state.step == 1:
            self.info.record_first_step(_since_launch())

    @torch.no_grad()
    def evaluate(self, batch_size: int = 1024) -> tuple[float, float]:
        """Loss and accuracy on the whole held-out split, summed over all ranks."""
        heartbeat.beat(self.state.step, "eval")
        self.model.eval()
        idx = eval_shard(len(self.test_x), self.rt.rank, self.rt.world_size)
        totals = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        net = eval_module(self.model)
        # The same number of batches on every rank (a short shard gets an empty last
        # batch): FSDP gathers parameters in each forward, a collective all must join.
        longest = -(-len(self.test_x) // self.rt.world_size)
        for i in range(0, longest, batch_size):
            j = idx[i:i + batch_size]
            x = self.test_x.index_select(0, j).to(self.rt.device)
            y = self.test_y.index_select(0, j).to(self.rt.device)
            with self.precision.autocast():
                out = net(x)
            loss_sum, correct = classification_sums(out, y)
            totals[0] += loss_sum
            totals[1] += correct
            totals[2] += len(y)
        if self.rt.distributed and self.rt.world_size > 1:
            dist.all_reduce(totals)
        self.model.train()
        n = max(totals[2].item(), 1.0)
        return totals[0].item() / n, totals[1].item() / n

    # -- bookkeeping ----------------------------------------------------------------
    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _done(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    def _global_mean(self, losses: list[torch.Tensor]) -> float:
        if not losses:
            return float("nan")
        t = torch.stack(losses).float().mean().reshape(1)
        if self.rt.distributed and self.rt.world_size > 1:
            dist.all_reduce(t)
            t /= self.rt.world_size
        return t.item()

    def flush_records(self) -> None:
        """Gather every rank's logged losses to rank 0 in one collective and write them."""
        if not self._records:
            return
        local = torch.stack([r[2].float() for r in self._records])
        if self.rt.distributed and self.rt.world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(self.rt.world_size)]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        if self.writer:
            rows = []
            for rank, losses in enumerate(gathered):
                for (epoch, step, _, sps, lr), loss in zip(self._records, losses.tolist()):
                    rows.append({"split": "train", "rank": rank, "epoch": epoch, "step": step,
                                 "loss": loss, "lr": lr, "samples_per_s": round(sps, 1)})
            self.writer.log(rows)
        self._records.clear()

    # -- checkpoints (what is saved and how: train/checkpoint.py) ------------------
    @property
    def checkpointer(self) -> Checkpointer:
        return Checkpointer(self.rt, checkpoint_dir(self.info.run_dir), self.model,
                            self.optimizer, self.scheduler, self.precision)

    def save(self) -> None:
        """A checkpoint of this step: rank 0 writes (atomically) what every rank needs."""
        heartbeat.beat(self.state.step, "checkpoint")
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

    def finish(self, last_eval: tuple[float, float], samples_per_s: float, wall_s: float,
               table: EpochTable) -> dict[str, Any]:
        """Hash-compare parameters over ranks and write summary.json / loss.png."""
        heartbeat.beat(self.state.step, "finish")
        # The whole state_dict, as params_sha256 always was (the built-in models have no
        # buffers); names the rank and tensor when they differ.
        sync = check_in_sync(self.model, "state")
        if not sync.in_sync:
            self.rt.print0(f"warning: {sync.describe()}")
        final = self.writer.last_train_loss() if self.writer else None
        summary = {
            **self.info.as_dict(),
            "epochs": self.state.epoch, "steps": self.state.step, "final_loss": final,
            "test_loss": last_eval[0], "test_accuracy": last_eval[1],
            "samples_per_s": samples_per_s,
            "params_sha256": sync.digests[self.rt.rank], "params_in_sync": sync.in_sync,
            "params_sha256_per_rank": sync.digests, "wall_s": round(wall_s, 3),
            **({} if sync.in_sync else {"params_divergence": sync.as_dict()}),
            **(self.comm.summary() if self.comm is not None else {}),
        }
        if self.writer:
            self.writer.finish(summary)
        table.footer(summary)
        heartbeat.stop()  # training is over: what the process does next is not watched
        return summary


def _since_launch() -> float | None:
    t0 = envvars.launch_t0()
    return round(time.time() - t0, 3) if t0 is not None else None


def classification_sums(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and count of correct argmax predictions of one eval batch.

    Sums, not means, so that the totals over all ranks' shards give the exact mean over
    the held-out set. This is the built-in workloads' metric (they are all classifiers);
    a model with other outputs needs its own.
    """
    loss_sum = nn.functional.cross_entropy(outputs.float(), targets, reduction="sum").double()
    return loss_sum, (outputs.argmax(dim=1) == targets).sum()
