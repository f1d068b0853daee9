"""The training loop, done the way seed 000 §5-§7 asks, with the pitfalls handled for you.

    from disttrain import JobSpec

    from disttrain.distributed import runtime
    from disttrain.train.trainer import build_trainer
    with runtime.setup() as rt:
        summary = build_trainer(JobSpec(), rt).fit()

What it takes care of: DistributedSampler.set_epoch every epoch; evaluation on the
held-out split with loss/accuracy summed over all ranks (not rank 0's shard); output and
files on rank 0 only; gradient accumulation with one all-reduce per optimizer step;
atomic checkpoints with RNG state and exact resume; a parameter-hash check that all
ranks ended identical. `Trainer.__init__` only stores parts; `build_trainer` builds them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrain.console import EpochTable
from disttrain.distributed.comm_hooks import CommStats
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.strategies import eval_module, is_fsdp, no_sync, unwrap
from disttrain.distributed.sync_check import check_in_sync
from disttrain.resilience import heartbeat
from disttrain.rundir import RunWriter
from disttrain.spec.job import TrainSpec
from disttrain.train.checkpoint import load_latest, rng_state, save_checkpoint, set_rng_state
from disttrain.train.data import ShardedLoader, eval_shard
from disttrain.train.precision import Precision

FLUSH_RECORDS = 50  # gather logged losses to rank 0 every this many records (one collective)


@dataclass
class TrainState:
    """Where training is: what a checkpoint must restore for an exact resume."""

    epoch: int = 0            # current epoch (0-based)
    batch_in_epoch: int = 0   # micro-batches of this epoch already consumed
    step: int = 0             # optimizer steps taken
    samples: int = 0          # samples this rank processed (for throughput)


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
    writer: RunWriter | None = None
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    info: dict[str, Any] = field(default_factory=dict)
    state: TrainState = field(default_factory=TrainState)
    comm: CommStats | None = None   # DDP comm hook's byte counter (builder registers it)
    _records: list[tuple[int, int, torch.Tensor, float, float]] = field(default_factory=list)

    # -- the loop -----------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for cfg.epochs (or max_steps), evaluate each epoch, return the summary."""
        t_start = time.perf_counter()
        # Heartbeat for the launcher's stall watchdog: phases from hooks, beats below.
        heartbeat.start(self.rt, self.model, self.optimizer)
        self.maybe_resume()
        samples_start = self.state.samples
        table = EpochTable(enabled=self.rt.is_rank0)
        table.header(self.info)
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
        self.loader.set_epoch(st.epoch)  # a new shuffle each epoch (seed 000 §5.1, §8.4)
        self.loader.skip = st.batch_in_epoch
        n_batches = len(self.loader)
        self.model.train()
        epoch_losses: list[torch.Tensor] = []
        t_log, samples_log = time.perf_counter(), 0
        progress = table.progress(n_batches, st.epoch)
        for x, y in self.loader:
            heartbeat.beat(st.step)  # attribute writes only; a thread publishes (issue 7)
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
            self.info["first_step_s"] = _since_launch()

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
            totals[0] += nn.functional.cross_entropy(out.float(), y, reduction="sum").double()
            totals[1] += (out.argmax(dim=1) == y).sum()
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

    def checkpoint_state(self, sharded: dict[str, Any] | None = None) -> dict[str, Any]:
        """What last.pt holds; `sharded` (FSDP) replaces model/optimizer by a DCP folder
        reference and the consolidated weights."""
        st = self.state
        weights = sharded if sharded is not None else {
            "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            "format": 1, **weights, "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "epoch": st.epoch, "batch_in_epoch": st.batch_in_epoch, "step": st.step,
            "samples": st.samples, "world_size": self.rt.world_size,
        }

    def save(self) -> None:
        """Rank 0 writes (atomically) what every rank needs; RNG states come from all ranks."""
        heartbeat.beat(self.state.step, "checkpoint")
        rngs = self.rt.all_gather_object(rng_state())
        sharded = None
        if is_fsdp(self.model):  # every rank writes its shards (a collective)
            from disttrain.distributed.fsdp import save_sharded

            sharded = save_sharded(self.info["run_dir"] / "checkpoints", self.state.step,
                                   self.model, self.optimizer, rank0=self.rt.is_rank0)
        if self.writer:
            state = self.checkpoint_state(sharded)
            state["rng"] = rngs
            save_checkpoint(self.writer.run_dir / "checkpoints", state, self.state.step)
        self.rt.barrier()  # nobody may read the checkpoint before it is complete

    def maybe_resume(self) -> None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        if not (self.cfg.resume or restarted):
            return
        ckpt_dir = self.info["run_dir"] / "checkpoints"
        found = load_latest(ckpt_dir)
        # All ranks must resume from the same step: a run dir that the nodes do not share
        # (a pod's own disk) would silently desynchronise them (issue 7).
        steps = self.rt.all_gather_object(None if found is None else found[0]["step"])
        if len(set(steps)) > 1:
            raise RuntimeError(f"resume: the ranks found different checkpoints in {ckpt_dir} "
                               f"(step by rank: {steps}); put train.run_dir on a volume that "
                               f"every node shares")
        if found is None:
            self.rt.print0("resume: no checkpoint found, starting from scratch")
            if self.writer:  # a restart before the first save: its records are redone
                self.writer.truncate_after(0)
            return
        ckpt, path = found
        if ckpt.get("world_size") != self.rt.world_size:
            raise RuntimeError(f"{path}: saved with world size {ckpt.get('world_size')}, "
                               f"this job has {self.rt.world_size}; the data order would differ")
        if ckpt.get("dcp"):  # FSDP: every rank loads its shards of model and optimizer
            from disttrain.distributed.fsdp import load_sharded

            load_sharded(path.parent / ckpt["dcp"], self.model, self.optimizer)
        else:
            unwrap(self.model).load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.precision.scaler and ckpt.get("scaler"):
            self.precision.scaler.load_state_dict(ckpt["scaler"])
        self.state = TrainState(ckpt["epoch"], ckpt["batch_in_epoch"], ckpt["step"],
                                ckpt.get("samples", 0))
        rngs = ckpt.get("rng") or []
        if self.rt.rank < len(rngs):
            set_rng_state(rngs[self.rt.rank])
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
        final = self._records_last_loss()
        summary = {
            **{k: (str(v) if k == "run_dir" else v) for k, v in self.info.items()},
            "epochs": self.state.epoch, "steps": self.state.step, "final_loss": final,
            "test_loss": last_eval[0], "test_accuracy": last_eval[1],
            "samples_per_s": samples_per_s,
            "params_sha256": sync.digests[self.rt.rank], "params_in_sync": sync.in_sync,
            "params_sha256_per_rank": sync.digests, "wall_s": round(wall_s, 3),
            **({} if sync.in_sync else {"params_divergence": sync.as_dict()}),
            **(self.comm.summary() if self.comm is not None else {}),
        }
        if self.writer:
            self.writer.write_summary(summary)
            self.writer.plot_loss()
            self.writer.close()
        table.footer(summary)
        heartbeat.stop()  # training is over: what the process does next is not watched
        return summary

    def _records_last_loss(self) -> float | None:
        if not self.writer:
            return None
        from disttrain.rundir import read_metrics

        train = [r for r in read_metrics(self.writer.metrics_path) if r.get("split") == "train"]
        if not train:
            return None
        last_step = max(r["step"] for r in train)
        vals = [r["loss"] for r in train if r["step"] == last_step]
        return sum(vals) / len(vals)


def _since_launch() -> float | None:
    t0 = os.environ.get("DISTTRAIN_T0")
    return round(time.time() - float(t0), 3) if t0 else None
