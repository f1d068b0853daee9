"""The `parallelism` section: how the world of ranks is split into a mesh of degrees.

    parallelism: {tp: 2}                  # tensor parallel over pairs of ranks
    disttrain run --example chargpt --nproc-per-node 2 --tp 2

    resolve_degrees(spec.parallelism, world_size=4)  # Degrees(pp=1, dp_replicate=1, dp_shard=2, tp=2)

The names and the "-1 = the rest" rule follow torchtitan's `ParallelismConfig`
(`data_parallel_shard_degree=-1` takes the ranks left over; reference:
../shared/reference/cluster-fit-and-scale.md §4): the product of the degrees must equal the
world size, and at most one degree may be -1. The default (every degree 1, dp_shard -1)
is plain data parallel over every rank, which the `train.strategy` (ddp / fsdp) runs, so a
spec without this section means what it always meant. With tp or pp, the ranks left over
(dp_shard) are data parallel on top, run as the strategy says (`check_supported`):

    disttrain run --example chargpt --nproc-per-node 4 --pp 2                   # pp=2 x dp=2
    disttrain run --example chargpt --nproc-per-node 4 --tp 2 --strategy fsdp   # FSDP2 x TP

Pure pydantic (the spec package is a leaf): the mesh itself is built from the resolved
degrees by `disttrain.distributed.mesh.build_mesh`, inside the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from disttrain.errors import SpecError
from disttrain.spec.fields import StrictModel

__all__ = ["DEGREE_NAMES", "Degrees", "ParallelismSpec", "check_microbatches", "check_supported",
           "resolve_degrees"]

# mesh dimensions, outermost first: pp across pods, tp innermost (its collectives are the
# most frequent and want the fastest link; torchtitan's ParallelDims uses the same order)
DEGREE_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")


class ParallelismSpec(StrictModel):
    """Degrees of each kind of parallelism; their product is the world size."""

    dp_replicate: int = Field(1, ge=-1, description="data-parallel replicas (HSDP's replicate "
                              "dimension); -1 = the ranks left over")
    dp_shard: int = Field(-1, ge=-1, description="data-parallel ranks (-1 = the ranks left over "
                          "after the other degrees: plain DDP/FSDP over every rank by default; "
                          "with tp or pp, replicas under ddp, FSDP2 shards of the tp model under "
                          "fsdp)")
    tp: int = Field(1, ge=-1, description="tensor-parallel degree: each Linear of the task's "
                    "tp plan split over this many ranks (docs/strategies.md)")
    pp: int = Field(1, ge=-1, description="pipeline stages: the model split at its block "
                    "boundaries over this many ranks")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field(
        "1f1b", description="pipeline schedule (torch.distributed.pipelining); interleaved-1f1b "
        "holds 2 model chunks per rank (stages r and r+pp), micro-batches a multiple of pp")
    microbatches: int = Field(4, ge=1, le=1024, description="pipeline micro-batches per batch "
                              "(a multiple of pp keeps every stage busy)")

    @model_validator(mode="after")
    def _degrees(self) -> ParallelismSpec:
        given = self.given_degrees()
        for name, value in given.items():
            if value == 0:
                raise ValueError(f"{name}: a degree is at least 1 (or -1 = the rest), not 0")
        rest = [n for n, v in given.items() if v == -1]
        if len(rest) > 1:
            raise ValueError(f"{rest[0]}: only one degree may be -1 (the rest), and "
                             f"{' and '.join(rest)} are; give the others a number")
        for name in ("pp_schedule", "microbatches"):  # not the default (dumps repeat defaults)
            if getattr(self, name) != type(self).model_fields[name].default and self.pp == 1:
                raise ValueError(f"{name}: applies to pipeline parallel only, and pp is 1; add "
                                 f"--pp 2 (or more), or drop --{name.replace('_', '-')}")
        return self

    def given_degrees(self) -> dict[str, int]:
        """The degrees as written; dp_shard's -1 (its default) yields to a -1 given
        elsewhere (`--tp -1` alone means "tp = every rank"). Not by "was it set": the
        launchers pass a full dump of the spec to the ranks, defaults included."""
        given = {n: getattr(self, n) for n in DEGREE_NAMES}
        if any(v == -1 for n, v in given.items() if n != "dp_shard"):
            given["dp_shard"] = 1
        return given

    @property
    def model_parallel(self) -> bool:
        """tp or pp asked for (the Trainer then builds a mesh instead of a DDP/FSDP wrapper)."""
        return self.tp != 1 or self.pp != 1


@dataclass(frozen=True)
class Degrees:
    """The resolved degrees (no -1): their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        """Ranks that see different data (the batch is split over these)."""
        return self.dp_replicate * self.dp_shard

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in DEGREE_NAMES)

    def describe(self) -> str:
        return " x ".join(f"{n}={getattr(self, n)}" for n in DEGREE_NAMES)


def resolve_degrees(p: ParallelismSpec, world_size: int) -> Degrees:
    """The degrees with -1 filled in from `world_size`.

    Raises:
        SpecError: the product does not equal the world size (or the rest does not divide
            it); one line naming every degree and the world size.
    """
    given = p.given_degrees()
    fixed = 1
    for v in given.values():
        fixed *= v if v != -1 else 1
    shown = ", ".join(f"{n}={v}" for n, v in given.items())
    rest = next((n for n, v in given.items() if v == -1), None)
    if rest is not None:
        if world_size % fixed:
            raise SpecError(f"parallelism: {shown}: the fixed degrees multiply to {fixed}, which "
                            f"does not divide the world size {world_size}; choose degrees whose "
                            f"product divides {world_size}, or change --nproc-per-node/--nnodes")
        given[rest] = world_size // fixed
    elif fixed != world_size:
        raise SpecError(f"parallelism: {shown}: the degrees multiply to {fixed} but the world size "
                        f"is {world_size}; make their product {world_size} (or set one degree "
                        f"to -1 = the rest)")
    return Degrees(**given)


def check_supported(d: Degrees, strategy: str) -> None:
    """What this version composes (issue 26 item 4), checked before any process starts:

    - plain data parallel (every degree but dp_shard 1): the strategy's (ddp / fsdp / ...);
    - tp or pp alone over every rank (strategy ddp or none: there is nothing to reduce);
    - pp x dp (`--pp 2 --nproc-per-node 4`, strategy ddp): each stage replicated over the
      dp ranks, its gradients averaged over them once per optimizer step
      (disttrain.distributed.composed.average_grads; why not a DDP wrapper: see there);
    - fsdp x tp (2-D, `--strategy fsdp --tp 2 --nproc-per-node 4`): `parallelize_module`
      over mesh["tp"], then FSDP2 `fully_shard` over mesh["dp_shard"] (torchtitan's order);
    - ddp x tp (`--tp 2 --nproc-per-node 4`, strategy ddp): the tp model replicated over
      the dp ranks, gradients averaged as under pp x dp.

    The data-parallel degree of a composed run is dp_shard (its default -1 takes the ranks
    left over); how it runs (replicas or shards) is the strategy's.

    Raises:
        SpecError: one line naming the degrees and the fix, for what is not built: tp with
            pp (3-D: torchtitan builds the stage's tp mesh first; not here yet), a
            dp_replicate degree > 1 (HSDP over a mesh: use --fsdp-sharding hybrid), fsdp
            with pp, strategy dp or none over several data-parallel ranks.
    """
    if d.dp_replicate > 1:
        raise SpecError(f"parallelism: {d.describe()}: a dp_replicate degree is not supported yet; "
                        f"give the data-parallel ranks to dp_shard (--dp-shard, or leave it -1 = "
                        f"the rest), or for replicas of FSDP shards use --fsdp-sharding hybrid")
    if d.tp == 1 and d.pp == 1:
        return
    if d.tp > 1 and d.pp > 1:
        raise SpecError(f"parallelism: {d.describe()}: tp and pp together are not supported yet; "
                        f"use one of them (each composes with data parallel: the rest of the ranks)")
    kind = "tp" if d.tp > 1 else "pp"
    if d.dp == 1 and strategy in ("fsdp", "dp"):
        raise SpecError(f"parallelism: {d.describe()}: strategy {strategy} splits the data over "
                        f"ranks and with {kind} over every rank there is no data-parallel rank; "
                        f"use --strategy ddp (the default) or none, or leave ranks for dp_shard")
    if d.dp == 1:
        return   # tp alone or pp alone over every rank (disttrain.train.model_parallel)
    if strategy == "fsdp" and kind == "pp":
        raise SpecError(f"parallelism: {d.describe()}: fsdp with pp is not supported yet; use "
                        f"--strategy ddp (each stage replicated over the dp_shard={d.dp_shard} ranks)")
    if strategy not in ("ddp", "fsdp"):
        raise SpecError(f"parallelism: {d.describe()}: strategy {strategy} with {kind} over "
                        f"dp_shard={d.dp_shard} data-parallel ranks would never average their "
                        f"gradients; use --strategy ddp{' or fsdp' if kind == 'tp' else ''}")


def check_microbatches(p: ParallelismSpec, batch_size: int) -> None:
    """Pipeline parallel splits each batch into `microbatches` equal parts (the stages are
    traced for one part's shape), so the count must divide the per-process batch; torch's
    interleaved 1F1B also wants it a multiple of pp (checked here when pp is a number,
    else in the ranks: `ModelParallel.setup`).

    Raises:
        SpecError: one line naming both numbers and the fix.
    """
    if p.pp != 1 and batch_size % p.microbatches:
        raise SpecError(f"parallelism.microbatches: {p.microbatches} does not divide "
                        f"train.batch_size {batch_size}; every micro-batch has the same rows "
                        f"(the pipeline's stages are traced for them): use a divisor of "
                        f"{batch_size}, or change --batch-size")
    if p.pp_schedule == "interleaved-1f1b" and p.pp > 1 and p.microbatches % p.pp:
        raise SpecError(f"parallelism.microbatches: {p.microbatches} is not a multiple of pp "
                        f"{p.pp}, which interleaved-1f1b needs (torch's schedule); use "
                        f"--microbatches {p.pp * max(1, p.microbatches // p.pp)}")
