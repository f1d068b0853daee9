"""Calibrate the memory plan's slice constants on a real GPU (plan/slice.py; docs/memory.md).

    python3 benchmarks/gpu_memory_check.py [--out DIR]     # called by gpu_check.sh

Measures, and prints as one JSON object (also OUT/gpu_memory.json):
- `context_mib`: one process's CUDA context: what NVML says the process uses after CUDA
  is initialised, minus what the caching allocator reserved (the plan's CUDA_CONTEXT_MIB);
- `nccl_mib`: what a 2-rank NCCL all-reduce adds per process beyond the tensors (needs two
  GPUs; NCCL_2GPU_MIB), measured by two processes on GPUs 0 and 1;
- for chargpt and SimpleNet, two training steps on the GPU against the plan of the same
  job: `max_memory_allocated` (the tensors), `max_memory_reserved` (what the allocator
  kept), their ratio (the plan's FRAGMENTATION) and the plan's peak / allocated.
Nothing here is asserted: it prints what the machine shows, to put in `gpumem_overhead`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


def nvml_used_mib(pid: int) -> float | None:
    """This process's GPU memory as the driver counts it (context included)."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory / MIB
    finally:
        pynvml.nvmlShutdown()
    return None


def context_mib() -> dict[str, Any]:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    used = nvml_used_mib(os.getpid())
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved() / MIB
    return {"context_mib": None if used is None else round(used - reserved, 1),
            "nvml_process_mib": used, "reserved_mib": round(reserved, 1),
            "mem_get_info_used_mib": round((total - free) / MIB, 1)}


def nccl_worker() -> None:
    """One rank of the 2-GPU NCCL measurement (run under torchrun)."""
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = nvml_used_mib(os.getpid()) or 0.0
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    dist.all_reduce(x)
    torch.cuda.synchronize()
    after = nvml_used_mib(os.getpid()) or 0.0
    if rank == 0:
        print(json.dumps({"nccl_mib": round(after - before, 1)}))
    dist.destroy_process_group()


def nccl_mib() -> dict[str, Any]:
    if torch.cuda.device_count() < 2:
        return {"nccl_mib": None, "nccl_note": "one GPU: NCCL needs a GPU per rank"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", __file__, "--nccl-worker"],
                          capture_output=True, text=True, timeout=180)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return {"nccl_mib": None, "nccl_note": (done.stderr or done.stdout)[-300:]}


def steps_vs_plan(name: str, task: Any, batch_size: int) -> dict[str, Any]:
    """Two real steps of one rank on cuda:0 (strategy none) against the plan."""
    from disttrain.plan.trace import Knobs, first_batch
    from disttrain.plan.tracing import trace_memory
    from disttrain.train.batch import to_device
    from disttrain.train.optim import build_optimizer
    from disttrain.train.steps import run_step

    knobs = Knobs(strategy="none", world_size=1, batch_size=batch_size)
    batch = first_batch(task, batch_size, 1)
    planned = trace_memory(task, knobs, batch).peak_bytes
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = (task.model() if callable(task.model) else task.model).cuda()
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    data = to_device(batch, torch.device("cuda"))
    for _ in range(2):
        loss, _ = run_step(task, model, data)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved()
    del model, opt, data
    return {"job": name, "planned_mib": round(planned / MIB, 1),
            "allocated_mib": round(allocated / MIB, 1), "reserved_mib": round(reserved / MIB, 1),
            "reserved_over_allocated": round(reserved / max(allocated, 1), 3),
            "plan_over_allocated": round(planned / max(allocated, 1), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-out"))
    ap.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.nccl_worker:
        nccl_worker()
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to calibrate (run on a GPU machine)")
        return 0
    from disttrain.examples import chargpt, digits

    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "cuda": torch.version.cuda, **context_mib(), **nccl_mib(),
                              "jobs": [steps_vs_plan("chargpt", chargpt.make_task(), 32),
                                       steps_vs_plan("simplenet", digits.make_task(), 256)]}
    print(json.dumps(result, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_memory.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
