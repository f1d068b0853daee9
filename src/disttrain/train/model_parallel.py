"""Tensor and pipeline parallel in the Trainer: the mesh, the split model, its step, its
evaluation and checkpoints (issue 26; the library parts are in disttrain.distributed).

    mp = ModelParallel.setup(spec, rt, task, model)   # mesh from the degrees, tp plan or stages
    model = mp.model              # what the Trainer holds: the tp model, or this rank's stage
    loader = make_loader(task, cfg, rt, shard=(mp.dp_rank, mp.dp_size))
    loss = mp.pipeline_step(batch, weight)            # pp: the schedule; every rank gets the loss

What each piece does differently from data parallel, and why:
- the data: ranks that differ only in tp or pp read the same batches (`mesh.data_rank`):
  a tp group computes one replica, and under pp every stage reads the whole batch (the
  first uses its input, the last its target) so that every rank's loader position,
  sample count and accumulation boundaries stay the same, which the loop's checkpoint
  and its stop agreement rely on; the cost is one index gather of unused data;
- pp traces its stages for micro-batches of `batch_size / microbatches` rows, so an
  epoch's short last batch is dropped (`SampledLoader.whole_batches`);
- interleaved 1F1B (`--pp-schedule interleaved-1f1b`): two chunks per rank (stages r and
  r + pp of 2 * pp, torch's loop layout) held in one ModuleDict as `model`: the optimizer
  covers both, the DCP checkpoint names them by stage ("stage2.blocks.2...."), evaluation
  runs the stages in order (rank 0, 1, ..., 0, 1, ...), the .pt and the sync check use the
  model's own names;
- the loss on pp is the last stage's, broadcast over the stage group for the log; the
  schedule runs with `scale_grads=False` and the loss is divided by the micro-batch count
  instead (torch's division would also hit the gradients accumulated by earlier micro-steps);
- evaluation: tp ranks run the same batches together (each forward is a collective); pp
  runs a plain forward through the stages with send/recv (any batch size) and scores on
  the last stage;
- checkpoints: torch.distributed.checkpoint, per rank (`ShardedLayout`): tp saves its
  DTensor shards (`tensor_parallel.dcp_view`), pp each stage its part; the .pt holds the
  consolidated weights as under FSDP;
- the end-of-run check compares each tensor among the ranks holding the same copy
  (`sync_check.check_copies_in_sync`): with data parallel on top, a stage's parameters or
  a tp shard among its dp replicas;
- data parallel on top (`_data_parallel`, disttrain.distributed.composed): each data slice
  (`mesh.data_rank`) is read by one tp group or one pipeline; under ddp the replicas'
  gradients are averaged over the dp ranks once per optimizer step (`before_optimizer_step`;
  why not a DDP wrapper: composed.py), under fsdp (tp only) FSDP2 shards the tp model over
  mesh["dp_shard"] and evaluates in lockstep (its forward is a dp collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import IterableDataset, default_collate

from disttrain.distributed.mesh import build_mesh, data_rank
from disttrain.distributed.pipeline import STAGES_PER_RANK, PipelinedModel, balanced_cuts, block_names
from disttrain.distributed.runtime import Runtime
from disttrain.distributed.stage_link import StageLink
from disttrain.distributed.sync_check import SyncReport, check_copies_in_sync, dtensor_copies
from disttrain.errors import SpecError, StrategyError
from disttrain.resilience import heartbeat
from disttrain.spec.job import JobSpec, TrainSpec
from disttrain.spec.parallelism import Degrees, check_supported, resolve_degrees
from disttrain.train.batch import batch_size_of, to_device
from disttrain.train.ckpt_sharded import ShardedLayout
from disttrain.train.evaluate import Evaluator
from disttrain.train.task import TaskError, TrainTask

__all__ = ["ModelParallel", "PipelineEvaluator"]


@dataclass
class ModelParallel:
    """The mesh of a tp or pp run (data parallel on top or not) and this rank's place in it."""

    degrees: Degrees
    mesh: DeviceMesh
    dp_rank: int                  # which slice of the data this rank reads
    dp_size: int                  # how many different slices there are (lr, samples/s)
    model: nn.Module              # the tp model, or this rank's pipeline stage
    pipe: PipelinedModel | None = None
    microbatches: int = 1
    rows: int = 0                 # pp: rows of one micro-batch (the stages are traced for it)
    weight: float = 1.0           # the current micro-batch's share of its accumulation group
    # data parallel on top (issue 26 item 4): "" none, "ddp" replicas averaging `averaged`'s
    # gradients over `dp_group`, "fsdp" FSDP2 over mesh["dp_shard"] (which averages all but
    # `averaged`: the fused biases it leaves alone; disttrain.distributed.composed)
    dp: str = ""
    averaged: list[nn.Parameter] = field(default_factory=list)
    reduce_dtype: torch.dtype | None = None   # fsdp: --comm-hook bf16 / fp16's dtype
    dp_group: Any = None

    @property
    def kind(self) -> str:
        """The summary's strategy_effective: tp, pp, ddp+tp, fsdp+tp or ddp+pp."""
        base = "pp" if self.pipe is not None else "tp"
        return f"{self.dp}+{base}" if self.dp else base

    def describe(self) -> str:
        extra = ""
        if self.pipe is not None:
            held = " and ".join(str(i + 1) for i in self.pipe.chunks)
            extra = (f", stage{'s' if len(self.pipe.chunks) > 1 else ''} {held} of "
                     f"{self.pipe.total_stages}, {self.microbatches} micro-batches")
        return f"parallelism: {self.degrees.describe()} ({self.kind}{extra}; data slices: {self.dp_size})"

    # -- build ------------------------------------------------------------------------
    @classmethod
    def setup(cls, spec: JobSpec, rt: Runtime, task: TrainTask, model: nn.Module) -> ModelParallel:
        """Build the mesh from the spec's degrees and split `model` over it.

        Raises:
            SpecError: degrees this version does not run (`check_supported`), or settings
                the split cannot honour (named, with the fix).
            StrategyError: the model does not fit the split (heads, blocks, no plan).
        """
        p, cfg = spec.parallelism, spec.train
        degrees = resolve_degrees(p, rt.world_size)
        check_supported(degrees, cfg.strategy)
        if isinstance(task.train_data, IterableDataset) or isinstance(task.eval_data, IterableDataset):
            raise SpecError("parallelism: tp/pp read map-style datasets (each rank of a model "
                            "replica must see the same batch); the task's data is an "
                            "IterableDataset; use a map-style Dataset or drop --tp/--pp")
        if task.load_weights is not None:
            raise SpecError("parallelism: tp/pp build the model whole, then split it; a task "
                            "with load_weights (built on meta) is not supported yet; drop --tp/--pp")
        mesh = build_mesh(degrees, rt)
        dp_rank, dp_size = data_rank(mesh)
        model = model.to(rt.device)
        if degrees.tp > 1:
            from disttrain.distributed.tensor_parallel import apply_tp, check_heads, tp_plan_for

            check_heads(model, degrees.tp)
            apply_tp(model, mesh["tp"], tp_plan_for(model, task.tp_plan))
            mp = cls(degrees, mesh, dp_rank, dp_size, model)
            if degrees.dp > 1:
                mp._data_parallel(cfg, task, rt)
            return mp
        if cfg.precision == "fp16":
            raise SpecError("train.precision: fp16's loss scaler is not wired into the pipeline "
                            "schedule; use --precision bf16 or fp32 with --pp")
        if cfg.grad_ckpt:
            raise SpecError("train.grad_ckpt: the pipeline's stages are traced from the plain "
                            "model; drop --grad-ckpt with --pp")
        if p.microbatches < 1 or cfg.batch_size % p.microbatches:
            raise SpecError(f"parallelism.microbatches: {p.microbatches} does not divide "
                            f"train.batch_size {cfg.batch_size}; every micro-batch has the same "
                            f"rows (the stages are traced for them)")
        if task.loss_fn is None:
            raise TaskError("pipeline parallel runs the loss on the last stage as "
                            "loss_fn(output, target); the task has only a step_fn (which runs "
                            "the whole model): give it a loss_fn for (input, target) batches")
        rows = cfg.batch_size // p.microbatches
        mp = cls(degrees, mesh, dp_rank, dp_size, model, microbatches=p.microbatches, rows=rows)
        example = _example_input(task, rows, rt.device)
        loss_fn = task.loss_fn

        def staged_loss(output: Any, target: Any) -> torch.Tensor:
            # mean over the batch = mean of equal micro-batches; times the accumulation weight
            return loss_fn(output, target) * (mp.weight / mp.microbatches)

        per_rank = STAGES_PER_RANK.get(p.pp_schedule, 1)
        if per_rank > 1 and p.microbatches % degrees.pp:
            raise SpecError(f"parallelism.microbatches: {p.microbatches} is not a multiple of "
                            f"pp {degrees.pp}, which {p.pp_schedule} needs (torch); use "
                            f"--microbatches {degrees.pp * max(1, p.microbatches // degrees.pp)}")
        stages = degrees.pp * per_rank
        if per_rank > 1 and task.fsdp_block is not None:
            blocks = len(block_names(model, task.fsdp_block))
            if stages > blocks:
                raise StrategyError(f"parallelism.pp: {p.pp_schedule} cuts {stages} stages "
                                    f"({per_rank} per rank) but the model has {blocks} blocks "
                                    f"({type(model).__name__}); use "
                                    + (f"--pp {blocks // per_rank} or fewer, or " if blocks >= 2 * per_rank
                                       else "") + "--pp-schedule 1f1b (one stage per rank)")
        mp.pipe = PipelinedModel.build(model, balanced_cuts(model, task.fsdp_block, stages),
                                       (example,), mesh["pp"], p.pp_schedule, p.microbatches,
                                       staged_loss, rt.device, scale_grads=False)
        mp.model = mp.pipe.stage_module
        if degrees.dp > 1:
            mp._data_parallel(cfg, task, rt)
        return mp

    def _data_parallel(self, cfg: TrainSpec, task: TrainTask, rt: Runtime) -> None:
        """Replicate (ddp) or shard (fsdp, tp only) the split model over the dp ranks
        (`check_supported` has refused the rest).

        Raises:
            SpecError: --cpu-offload with FSDP2 x TP (its offload policy is not wired in).
        """
        self.dp_group = _dp_group(self.mesh)
        if cfg.strategy == "fsdp":
            from disttrain.distributed.composed import fully_shard_tp

            if getattr(cfg, "cpu_offload", False):
                raise SpecError("train.cpu_offload: not wired into FSDP2 x TP yet; drop "
                                "--cpu-offload with --tp and --strategy fsdp")

            block = task.fsdp_block
            units = block if isinstance(block, tuple) else ((block,) if block is not None else None)
            self.dp = "fsdp"
            from disttrain.distributed.fsdp import REDUCE_DTYPES

            self.reduce_dtype = REDUCE_DTYPES.get(cfg.comm_hook)
            self.averaged = fully_shard_tp(self.model, self.mesh["dp_shard"], units,
                                           gloo=rt.backend == "gloo",
                                           reduce_dtype=self.reduce_dtype)
            return
        self.dp = "ddp"
        self.averaged = self.parameters()

    def reduced_grad_bytes(self) -> int:
        """Gradient bytes this rank sends into the data-parallel reduction per optimizer
        step (summary.json's `allreduce_bytes_per_step`): under ddp the replicas' all-reduce
        of `averaged`; under fsdp the reduce-scatter input, this rank's tp piece of each
        parameter (the local FSDP shard times the dp degree), plus the fused biases it
        averages by hand; 0 without data parallel. Counted from the split model, so a tp
        piece counts as a tp piece (counting the model before the split gave tp times too
        much)."""
        from torch.distributed.tensor import DTensor

        if not self.dp:
            return 0
        by_hand = {id(p) for p in self.averaged}
        total = 0
        for p in self.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if self.dp == "ddp" or id(p) in by_hand:   # all-reduced as they are
                total += local.numel() * local.element_size()
                continue
            total += local.numel() * self.dp_size * (self.reduce_dtype or local.dtype).itemsize
        return total

    def parameters(self) -> list[nn.Parameter]:
        """What this rank's optimizer updates."""
        params = self.pipe.parameters() if self.pipe is not None else list(self.model.parameters())
        return [p for p in params if p.requires_grad]

    def evaluator(self, task: TrainTask, rt: Runtime, precision: Any, batch_size: int,
                  num_workers: int) -> Evaluator:
        """The held-out set split over the data slices, not the ranks."""
        kind = PipelineEvaluator if self.pipe is not None else Evaluator
        # FSDP's forward is a collective over the dp ranks: every one runs as many batches
        ev = kind(task, rt, precision, batch_size=batch_size, lockstep=self.dp == "fsdp",
                  num_workers=num_workers)
        ev.data_rank, ev.data_world = self.dp_rank, self.dp_size
        ev.reduce_group = _dp_group(self.mesh)
        if isinstance(ev, PipelineEvaluator):
            ev.mp = self
        return ev

    # -- the step ---------------------------------------------------------------------
    def pipeline_step(self, batch: Any, weight: float) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; the batch's mean loss
        from the last stage, on every rank of the pipeline (broadcast for the log)."""
        assert self.pipe is not None
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise TaskError("pipeline parallel needs (input, target) batches")
        inputs, target = batch
        rows = batch_size_of(batch)
        if rows % self.microbatches:
            raise TaskError(f"a batch of {rows} rows does not split into {self.microbatches} "
                            f"equal micro-batches")
        self.weight = weight
        loss = self.pipe.step(inputs, target)
        out = torch.zeros((), device=inputs.device)
        if loss is not None:   # the mean of the micro-batches' loss * weight / microbatches
            out = (loss * (self.microbatches / weight)).reshape(())
        dist.broadcast(out, src=_ranks(self.pipe.group)[-1], group=self.pipe.group)
        return out

    def before_optimizer_step(self) -> None:
        """pp: the tied weights' copies on different stages get one summed gradient; with
        data parallel on top, the replicas' gradients (fsdp: those FSDP leaves alone) are
        averaged over the dp ranks (after the tied sum: both are linear, either order)."""
        if self.pipe is not None:
            self.pipe.sync_tied_grads()
        if self.averaged:
            from disttrain.distributed.composed import average_grads

            average_grads(self.averaged, self.dp_group)

    # -- checkpoints and the end-of-run check -------------------------------------------
    def layout(self, optimizer: torch.optim.Optimizer) -> ShardedLayout:
        """How this rank's part of model and optimizer goes to and from a DCP folder."""
        if self.pipe is not None:
            pipe = self.pipe
            return ShardedLayout(state=lambda: pipe.checkpoint_state(optimizer),
                                 load=lambda state: pipe.load_checkpoint_state(optimizer, state),
                                 full=pipe.full_state_dict)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from disttrain.distributed.tensor_parallel import dcp_view, full_state_dict

        model = self.model
        held: dict[str, Any] = {}

        def state() -> dict[str, Any]:
            msd, osd = get_state_dict(model, optimizer)
            held["state"] = {"model": msd, "optimizer": osd}
            return dcp_view(held["state"])   # views: loading the view fills held["state"]

        def load(_: dict[str, Any]) -> None:
            set_state_dict(model, optimizer, model_state_dict=held["state"]["model"],
                           optim_state_dict=held["state"]["optimizer"])

        return ShardedLayout(state=state, load=load, full=lambda: full_state_dict(model))

    def check_in_sync(self) -> SyncReport:
        """Each tensor compared among the ranks that hold the same copy of it."""
        if self.pipe is None:
            return check_copies_in_sync(dtensor_copies(self.model, "state"))
        canonical = {a: aliases[0] for aliases in self.pipe.tied for a in aliases}
        items = [(canonical.get(n, n), p.detach()) for n, p in self.pipe.named_used_parameters()]
        items += self.pipe.named_buffers()
        return check_copies_in_sync(items)


class PipelineEvaluator(Evaluator):
    """Evaluation through the stages: each stage runs its part of a plain forward and
    sends the activation on; the last stage scores, then shares the sums with the other
    stages. The traced stages take micro-batches of `mp.rows` rows only (their shapes are
    fixed by the trace), so each eval batch goes through in pieces of that size, the last
    piece padded with copies of its first row that are not scored.

    The pieces go through as a wavefront, `WINDOW` at a time: a rank runs its first stage
    on every piece of the window, sending each on without waiting (`StageLink`), then its
    next stage on each as it arrives. One piece at a time, every piece paid every hop's
    latency in turn: a 2-rank interleaved chargpt spent 11 s of a 30-step test job in
    evaluation (1,453 pieces of 2 rows, 3 hops each, two messages a hop)."""

    mp: ModelParallel
    WINDOW = 64

    @torch.no_grad()
    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        if not self.enabled:
            return {}
        pipe = self.mp.pipe
        assert pipe is not None and self.task.loss_fn is not None
        heartbeat.beat(step, "eval")
        was_training = model.training
        model.eval()
        ranks = _ranks(pipe.group)
        total = pipe.total_stages   # stage s runs on rank s % pp (one stage per rank: s)
        sums = torch.zeros(2 * len(self.names), dtype=torch.float64, device=self.rt.device)
        link = StageLink(pipe.group)
        window: list[tuple[torch.Tensor, torch.Tensor, int, bool]] = []
        for piece in self._pieces():
            window.append(piece)
            if len(window) == self.WINDOW:
                self._through(window, pipe, ranks, total, link, sums)
                window = []
        if window:
            self._through(window, pipe, ranks, total, link, sums)
        link.wait()
        dist.broadcast(sums, src=ranks[-1], group=pipe.group)
        if self.data_world > 1:
            dist.all_reduce(sums, group=self.reduce_group)
        model.train(was_training)
        values = sums.tolist()
        return {name: (values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan"))
                for i, name in enumerate(self.names)}

    def _pieces(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, bool]]:
        """(input of `mp.rows` rows, target, rows to score, scored) of every eval piece."""
        rows = self.mp.rows
        for batch, real in self._batches():
            xs, ys = to_device(batch, self.rt.device)
            for start in range(0, batch_size_of(batch), rows):
                x, y = xs[start:start + rows], ys[start:start + rows]
                n = len(x)
                if n < rows:   # pad to the traced shape; the copies are not scored
                    x = torch.cat([x, x[:1].expand(rows - n, *x.shape[1:])])
                yield x, y, n, real

    def _through(self, window: list[tuple[torch.Tensor, torch.Tensor, int, bool]],
                 pipe: PipelinedModel, ranks: list[int], total: int, link: StageLink,
                 sums: torch.Tensor) -> None:
        """This rank's stages, in order, each on every piece of the window; the last
        stage scores."""
        outs = [x for x, _, _, _ in window]
        for index, chunk in pipe.chunks.items():   # this rank's stages, in order
            for k in range(len(window)):
                h = outs[k] if not index else link.recv(
                    ranks[(index - 1) % len(ranks)], index - 1, self.rt.device)
                with self.precision.autocast():
                    h = _single(chunk(h))
                if index < total - 1:
                    link.send(h, ranks[(index + 1) % len(ranks)], index)
                outs[k] = h
        if total - 1 not in pipe.chunks:
            return
        for (x, y, n, real), h in zip(window, outs):
            if not real:
                continue
            h = h[:n]
            sums[0] += self.task.loss_fn(h, y).detach().double() * n
            sums[1] += n
            for i, fn in enumerate(self.task.metrics.values(), start=1):
                scored, count = fn(h, (x[:n], y))
                sums[2 * i] += float(scored)
                sums[2 * i + 1] += float(count)


# -- helpers ---------------------------------------------------------------------------------
def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def _dp_group(mesh: DeviceMesh) -> Any:
    """The process group of this rank's data-parallel peers (None with one data slice)."""
    if mesh["dp_shard"].size() * mesh["dp_replicate"].size() == 1:
        return None
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"].get_group()
    return mesh["dp_replicate", "dp_shard"]._flatten().get_group()


def _example_input(task: TrainTask, rows: int, device: torch.device) -> torch.Tensor:
    """One micro-batch of inputs for tracing the stages: the first sample, `rows` times."""
    collate: Callable[[list[Any]], Any] = task.collate_fn or default_collate
    batch = collate([task.train_data[0]] * rows)
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)):
        raise TaskError("pipeline parallel needs (input tensor, target) batches to trace the stages")
    return batch[0].to(device)


def _single(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise StrategyError("pipeline parallel evaluation passes one tensor between stages; "
                            f"a stage returned {type(out).__name__}")
    return out
