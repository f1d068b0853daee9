"""Rules that need to know the machine: can this host run the job as asked?

    notes = check_runnable(spec, gpus=local_gpu_count())              # disttrain run
    notes = check_runnable(spec, gpus=dp_gpu_count(rt), world_size=rt.world_size)  # a rank

Rules that the spec alone decides (dp with several processes per node, powersgd under
FSDP, ...) are JobSpec validators and fail at load time. What is left depends on the
host: the GPUs this process can use and the job's world size. The caller counts them
(`disttrain.launch.devices.local_gpu_count` before launch, the runtime inside a rank),
so this module stays pure and torch-free, and `disttrain run` refuses up front exactly
what the builder inside every rank would refuse, with the same words.
"""

from __future__ import annotations

from disttrain.errors import PrecisionError, SpecError, StrategyError
from disttrain.spec.job import JobSpec

__all__ = ["DP_ADVICE", "check_dp_world_size", "check_precision", "check_runnable"]

# Printed (by rank 0) whenever the built-in job asks for --strategy dp: DP still looks like
# the easy choice to many users, and the reasons it is slower are not visible from outside.
DP_ADVICE = (
    "note: DDP (--strategy ddp, the default) is the recommended choice over DataParallel: "
    "DP runs every GPU from threads of one Python process, so the GIL serialises them, and "
    "it scatters inputs, gathers outputs and reduces gradients on GPU 0, which carries more "
    "memory and work than the others and re-broadcasts the model every step; DDP runs one "
    "process per GPU and overlaps an all-reduce of gradients with the backward pass.")


def check_precision(precision: str, on_cuda: bool) -> None:
    """fp16 autocast needs CUDA: CPU autocast has no fp16 kernels worth having, and the
    loss scaler that fp16's narrow range needs is a CUDA one.

    Raises:
        PrecisionError: fp16 without a CUDA device; the message points to bf16.
    """
    if precision == "fp16" and not on_cuda:
        raise PrecisionError("train.precision: fp16 autocast needs a CUDA GPU; on CPU use "
                             "--precision bf16")


def check_dp_world_size(world_size: int, launcher: str = "torchrun") -> None:
    """DataParallel is one process driving every visible GPU: other ranks have nothing
    to do. The fix named depends on where the extra processes come from: WORLD_SIZE
    under `--launcher env`, the process count otherwise.

    Raises:
        StrategyError: strategy dp with `world_size` > 1.
    """
    if world_size <= 1:
        return
    if launcher == "env":
        raise StrategyError(
            f"WORLD_SIZE={world_size}: strategy dp is ONE process that drives all visible GPUs "
            f"(nn.DataParallel), so there is nothing for other ranks to do; set "
            f"WORLD_SIZE=1, or use --strategy ddp (one process per GPU, recommended)")
    raise StrategyError(
        f"train.strategy: dp (DataParallel) runs in one process over all its GPUs, but "
        f"this job has {world_size} processes; use --nproc-per-node 1 with dp, or "
        f"--strategy ddp")


def check_runnable(spec: JobSpec, gpus: int, world_size: int | None = None) -> list[str]:
    """Refuse a job this host cannot run; return the notes to print about how it will run.

    Args:
        spec: the job.
        gpus: CUDA GPUs this process can use (0 on CPU, or when the rank runs on CPU).
        world_size: the job's process count when known (inside a rank, or WORLD_SIZE
            under `--launcher env`); None skips the rules that need it.

    Returns:
        Notes for rank 0's start banner (the DataParallel advice when dp is asked for).

    Raises:
        SpecError: backend nccl without a GPU.
        PrecisionError: fp16 without a GPU (built-in job).
        StrategyError: strategy dp in a job of several processes (built-in job), or
            sync_batchnorm without a GPU.
    """
    notes: list[str] = []
    if not spec.script:  # a user script reads its own arguments, not `train`
        cfg = spec.train
        if cfg.strategy == "dp" and world_size is not None:
            check_dp_world_size(world_size, spec.launch.launcher)
        check_precision(cfg.precision, on_cuda=gpus > 0)
        notes += [DP_ADVICE] if cfg.strategy == "dp" else []
        if cfg.sync_batchnorm and gpus == 0:
            raise StrategyError(
                "train.sync_batchnorm: SyncBatchNorm runs on CUDA GPUs only and none is visible; "
                "drop --sync-batchnorm (on CPU the Trainer still makes every rank's BatchNorm "
                "statistics rank 0's before each evaluation and checkpoint)")
    if spec.launch.backend == "nccl" and gpus == 0:
        raise SpecError("launch.backend: nccl needs CUDA GPUs and none is visible; use "
                        "--backend gloo (or auto)")
    return notes
