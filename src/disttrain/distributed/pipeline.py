"""Pipeline parallel with torch.distributed.pipelining: stages cut at the task's block
boundaries, balanced by parameter count, run by torch's GPipe / 1F1B / interleaved 1F1B
schedules.

    cuts = balanced_cuts(model, task.fsdp_block, pp=2)          # ["blocks.2"]
    pipe = PipelinedModel.build(model, cuts, example_microbatch, mesh["pp"], "1f1b", 4, loss_fn)
    loss = pipe.step(x, y)        # forward + backward of one batch; the loss on the last stage
    pipe.sync_tied_grads()        # tied weights split over stages (chargpt's tok/head)
    full = pipe.full_state_dict() # every stage's parameters, gathered on every rank

The model is split by torch's tracing frontend (`pipeline(model, mb_args, split_spec)`,
torch.export underneath), so any model whose forward exports splits without changes to it
(tutorial: pytorch.org/docs/stable/distributed.pipelining.html). Cuts go at the
beginning of block instances (`SplitPoint.BEGINNING`): what comes before the first block
(embeddings) is on stage 0, what follows the last (norm, head) on the last stage; the cut
positions minimise the largest stage's parameter count. Each stage runs its generated
Python code, not torch.fx's node-by-node interpreter (`_generated`: x1.27 samples/s on a
small model, docs/performance.md).

A weight tied across stages (a head sharing the token embedding) is one Parameter in the
model but a copy on each stage that uses it after the split; Megatron keeps the copies
equal by summing their gradients over the stages that hold them before the step, and so
does `sync_tied_grads`. Schedules on gloo: GPipe and 1F1B from torch 2.8 (the gloo p2p hang
pytorch#132644 was fixed by #152938; reference: ../shared/reference/cluster-fit-and-scale.md §4).

Interleaved 1F1B (`ScheduleInterleaved1F1B`, runs on gloo in torch 2.13): the model is cut
into `pp * STAGES_PER_RANK` stages and rank r of the pp group holds stages r and r + pp
(torch's loop layout), so the first stage and the last are on ranks 0 and pp - 1 as
before. The rank's chunks are held in one `nn.ModuleDict` ("stage0", "stage2", ...:
what the Trainer's optimizer, checkpoint and hash see, so checkpoint keys are
stage-qualified); `full_state_dict` and the sync check use the original model's names.
torch wants the micro-batches a multiple of pp (`disttrain.spec.parallelism`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from disttrain.errors import StrategyError

__all__ = ["SCHEDULES", "STAGES_PER_RANK", "PipelinedModel", "balanced_cuts", "block_names"]

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B"}
# model chunks per rank of a multi-stage schedule (torch's loop layout: rank r holds r, r + pp)
STAGES_PER_RANK = {"interleaved-1f1b": 2}


def block_names(model: nn.Module, block: type | tuple[type, ...] | None) -> list[str]:
    """FQNs of the outermost instances of `block`, in module order.

    Raises:
        StrategyError: no block class, or the model has no instance of it.
    """
    if block is None:
        raise StrategyError("pipeline parallel cuts the model at the task's blocks: give the "
                            "TrainTask fsdp_block=YourBlockClass (docs/your-model.md)")
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, block) and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    if not names:
        raise StrategyError(f"pipeline parallel: the model has no {block} instance to cut at")
    return names


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_cuts(model: nn.Module, block: type | tuple[type, ...] | None, pp: int) -> list[str]:
    """The `pp - 1` block FQNs that begin stages 1..pp-1, chosen so that the largest stage
    (blocks plus the embeddings on the first and the rest on the last) has the fewest
    parameters.

    Raises:
        StrategyError: pp larger than the number of blocks (one line naming both).
    """
    names = block_names(model, block)
    if pp > len(names):
        raise StrategyError(f"parallelism.pp: {pp} stages but the model has {len(names)} blocks "
                            f"({type(model).__name__}); use --pp {len(names)} or fewer")
    sizes = [_param_count(model.get_submodule(n)) for n in names]
    seen = {id(p) for n in names for p in model.get_submodule(n).parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    sizes[0] += rest // 2      # embeddings before, norm + head after: half on each end
    sizes[-1] += rest - rest // 2
    # best[k][i]: the smallest largest-stage for blocks[:i] in k stages (and where it cut)
    inf = float("inf")
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut_at = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut_at[k][i] = cost, j
    cuts, i = [], n
    for k in range(pp, 1, -1):
        i = cut_at[k][i]
        cuts.append(names[i])
    return cuts[::-1]


def _used_params(stage: nn.Module) -> set[str]:
    """Parameter FQNs the stage's traced graph really uses (the split keeps unused copies
    of tied weights as attributes)."""
    graph = getattr(stage, "graph", None)
    if graph is None:
        return {n for n, _ in stage.named_parameters()}
    prefixes = [str(node.target) for node in graph.nodes if node.op in ("call_module", "get_attr")]
    return {n for n, _ in stage.named_parameters()
            if any(n == p or n.startswith(p + ".") for p in prefixes)}


@dataclass
class PipelinedModel:
    """This rank's stage(s) of a pipeline and the schedule that drives it.

    `stage_index` / `num_stages` are this rank's place in the pp group and its size (one
    stage per rank but under interleaved 1F1B, whose stages are in `chunks`)."""

    stage_module: nn.Module           # the stage, or a ModuleDict of this rank's chunks
    schedule: Any
    stage_index: int
    num_stages: int
    group: Any
    tied: list[list[str]]             # alias FQNs of each weight the original model ties
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    chunks: dict[int, nn.Module] = field(default_factory=dict)   # global stage index -> module

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = {self.stage_index: self.stage_module}

    @property
    def total_stages(self) -> int:
        """Stages of the whole pipeline (pp times the chunks per rank)."""
        return self.num_stages * len(self.chunks)

    def _prefix(self, index: int) -> str:
        """Where a chunk's names sit in `stage_module` ("" with one stage per rank)."""
        return "" if len(self.chunks) == 1 else f"stage{index}."

    def named_used_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's used parameters under the original model's names."""
        out: list[tuple[str, nn.Parameter]] = []
        for chunk in self.chunks.values():
            used = _used_params(chunk)
            out += [(n, p) for n, p in chunk.named_parameters() if n in used]
        return out

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's buffers under the original model's names."""
        return [(n, b) for chunk in self.chunks.values() for n, b in chunk.named_buffers()]

    def _used(self) -> set[str]:
        """Used parameter names as `stage_module` names them."""
        return {self._prefix(i) + n for i, chunk in self.chunks.items() for n in _used_params(chunk)}

    @classmethod
    def build(cls, model: nn.Module, cuts: Sequence[str], microbatch: tuple[Any, ...],
              pp_mesh: DeviceMesh, schedule: str, microbatches: int,
              loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device,
              scale_grads: bool = True) -> PipelinedModel:
        """Split `model` at `cuts` (one stage per rank of `pp_mesh`, or STAGES_PER_RANK of
        them under a multi-stage schedule: then `cuts` has pp * that - 1) and make the schedule.

        Args:
            microbatch: example positional inputs of ONE micro-batch (tracing shapes).
            loss_fn: `loss_fn(output, target) -> scalar`, run on the last stage per
                micro-batch (the schedule averages the gradients over micro-batches).
            scale_grads: torch divides every gradient by `microbatches` after the
                schedule's backward; False when the loss is divided instead (the Trainer's
                gradient accumulation: torch's division would also hit the gradients
                accumulated by the previous step() calls of the same optimizer step).
        """
        from torch.distributed import pipelining

        if schedule not in SCHEDULES:
            raise StrategyError(f"parallelism.pp_schedule: {schedule!r}; choose one of "
                                f"{', '.join(SCHEDULES)}")
        pp = pp_mesh.size()
        per_rank = STAGES_PER_RANK.get(schedule, 1)
        if len(cuts) != pp * per_rank - 1:
            raise StrategyError(f"pipeline parallel: {len(cuts)} cut(s) for {pp * per_rank} stages")
        if per_rank > 1 and microbatches % pp:
            raise StrategyError(f"parallelism.microbatches: {microbatches} is not a multiple of "
                                f"pp {pp}, which {schedule} needs")
        tied = _tied_groups(model)
        shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
        pipe = pipelining.pipeline(model, mb_args=microbatch, split_spec={
            c: pipelining.SplitPoint.BEGINNING for c in cuts})
        index = pp_mesh.get_local_rank()
        group = pp_mesh.get_group()
        kind = getattr(pipelining, SCHEDULES[schedule])
        if per_rank == 1:
            stage = pipelining.build_stage(_generated(pipe.get_stage_module(index)), index,
                                           pipe.info(), device, group)
            sched = kind(stage, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
            return cls(stage.submod, sched, index, pp, group, tied, shapes)
        stages = [pipelining.build_stage(_generated(pipe.get_stage_module(i)), i, pipe.info(),
                                         device, group)
                  for i in range(index, pp * per_rank, pp)]
        sched = kind(stages, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        chunks = {st.stage_index: st.submod for st in stages}
        holder = nn.ModuleDict({f"stage{i}": m for i, m in chunks.items()})
        return cls(holder, sched, index, pp, group, tied, shapes, chunks)

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """What this rank's optimizer updates: the parameters its stage(s) use."""
        return [p for _, p in self.named_used_parameters()]

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the batch's mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        if self.stage_index == 0:
            self.schedule.step(inputs, target=target if self.is_last else None, losses=losses)
        elif self.is_last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        return torch.stack(losses).mean().detach() if self.is_last else None

    def sync_tied_grads(self) -> None:
        """Sum the gradients of each tied weight over the stages that use a copy of it, so
        the copies stay equal (a collective over the pp group, in the same order on every
        stage: one all-reduce per tied weight)."""
        per_chunk = []
        for chunk in self.chunks.values():
            per_chunk.append((_used_params(chunk), dict(chunk.named_parameters())))
        for aliases in self.tied:
            grads = []      # per chunk: the copy's gradient (one per chunk: its first alias)
            for used, params in per_chunk:
                mine = [a for a in aliases if a in used]
                if mine and params[mine[0]].grad is not None:
                    grads.append(params[mine[0]].grad)
            if len(grads) == 1:
                buf = grads[0]
            else:
                buf = torch.zeros(self.shapes[aliases[0]], device=grads[0].device if grads else None)
                for g in grads:
                    buf += g
            dist.all_reduce(buf, group=self.group)
            for used, params in per_chunk:
                for a in aliases:
                    if a in used and params[a].grad is not None and params[a].grad is not buf:
                        params[a].grad.copy_(buf)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This stage's model and optimizer state under the original model's names, for
        torch.distributed.checkpoint: stages hold disjoint keys (an unused copy of a tied
        weight is left out, so two stages never write one key; the optimizer's
        param_groups are per stage, so they are kept under the stage's own key)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.stage_module, optimizer)
        used = self._used()
        buffers = {n for n, _ in self.stage_module.named_buffers()}
        return {"model": {k: v for k, v in model_sd.items() if k in used or k in buffers},
                self._optim_key: optim_sd}

    @property
    def _optim_key(self) -> str:
        return "optim_stage" + "_".join(str(i) for i in self.chunks)

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Put a loaded `checkpoint_state` back into this stage and its optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.stage_module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state[self._optim_key],
                       options=StateDictOptions(strict=False))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's used parameters gathered on every rank (a collective), under the
        original model's names, tied aliases filled from the copy a stage uses."""
        mine = {n: p.detach().cpu() for n, p in self.named_used_parameters()}
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, mine, group=self.group)
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        for aliases in self.tied:
            known = next((full[a] for a in aliases if a in full), None)
            for a in aliases:
                if known is not None:
                    full.setdefault(a, known)
        return full


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """FQNs that name one Parameter, for each Parameter named more than once."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _generated(stage_module: nn.Module) -> nn.Module:
    """`stage_module` with its traced submodules run by their generated Python code, as
    a GraphModule runs, instead of node by node through `torch.fx.Interpreter`.

    Why: torch.export's unflattened modules (`InterpreterModule`, what the pipelining
    frontend's stages are made of) interpret their graph on every call by default, and
    `Interpreter.run` also makes a (disabled) tqdm progress bar per call, whose first
    one creates a multiprocessing lock registered with the resource tracker: a rank
    killed later leaves it registered, and the job ended with "resource_tracker: There
    appear to be 1 leaked semaphore objects". The generated code runs the same ops in the
    same order: a 2-rank pp chargpt run (30 steps) ended with the same parameters
    (sha256), 382-396 against 304-307 samples/s, 6.7-6.8 against 9.3 s of CPU
    (docs/performance.md). `_run_with_interpreter` is torch's own switch
    (`torch.export.unflatten._disable_interpreter` sets it for modules made under it);
    a torch without it keeps the interpreter."""
    from torch.export.unflatten import InterpreterModule

    for module in stage_module.modules():
        if isinstance(module, InterpreterModule) and hasattr(module, "_run_with_interpreter"):
            module._run_with_interpreter = False
    return stage_module


def interpreted(stage_module: nn.Module) -> int:
    """How many of `stage_module`'s submodules torch would still run node by node."""
    from torch.export.unflatten import InterpreterModule

    return sum(isinstance(m, InterpreterModule) and getattr(m, "_run_with_interpreter", True)
               for m in stage_module.modules())
