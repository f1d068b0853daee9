"""Signatures of the machine side of a job: GPUs, builds, memory, /dev/shm, DDP, dying ranks.

Each pattern is the wording of the code that prints it, in every release where it changed
(see docs/troubleshooting.md for the eras):

- /dev/shm for DataLoader workers and torch.multiprocessing (TH/ATen MapAllocator):
  torch 0.4-2.x `unable to write to file </torch_...>`, `unable to open shared memory
  object </torch_...> in read-write mode`, `unable to mmap N bytes from file </torch_...>`,
  `unable to resize file <...> to the right size`; torch 2.x `unable to allocate shared
  memory(shm) for file </torch_...>: No space left on device (28)`; the worker's own
  `Unexpected bus error encountered in worker. This might be caused by insufficient
  shared memory (shm)` and the loader's `DataLoader worker (pid N) is killed by signal:
  Bus error` (until 1.x `Details are lost due to multiprocessing`, later `It is possible
  that dataloader's workers are out of shared memory`);
- /dev/shm for NCCL: 2.4-2.11 `Call to posix_fallocate failed : No space left on device`
  then `Error while creating shared memory segment NAME (size N)`; 2.12-2.18 `Error:
  failed to extend /dev/shm/nccl-XXXX to N bytes`; 2.19+ the same with `, error: ...`,
  and `failed to create shared memory file ..., error Permission denied (13)`;
- a rank killed by SIGBUS: torchrun's `exitcode: -7` / `Signal 7 (SIGBUS)`, mp.spawn's
  `process 1 terminated with signal SIGBUS`, torch.distributed.launch's
  `died with <Signals.SIGBUS: 7>`;
- builds: NCCL >= 2.23 `Mismatched NCCL version detected`; older NCCL fails the bootstrap
  exchange with `Message truncated : received N bytes instead of M`; the driver: `The
  NVIDIA driver on your system is too old`, CUDA's `CUDA driver version is insufficient`
  (error 35), 803/804 (`unsupported display driver / cuda driver combination`,
  `forward compatibility was attempted on non supported HW`); architectures: `no kernel
  image is available`, `invalid device function` (older), `PyTorch no longer supports
  this GPU because it is too old`; CPU-only builds: `Torch not compiled with CUDA
  enabled`, `module 'torch._C' has no attribute '_cuda_setDevice'`;
- DDP's unused-parameter error (reducer.cpp), whose every sentence is matched so that the
  tail of a cut paste is enough.
"""

from __future__ import annotations

from disttrain.diagnose.log_causes import CPU_BUILD, ORDINAL
from disttrain.diagnose.log_signature import CONSEQUENCE, LIKELY, RANK, ROOT, Signature, sig

_SHM_PERMISSION = (
    "/dev/shm is not writable for this process (Permission denied)",
    "Shared memory lives in /dev/shm: it must be a writable tmpfs for the user the job "
    "runs as. In Kubernetes mount an emptyDir `{{medium: Memory, sizeLimit: 2Gi}}` at "
    "/dev/shm (disttrain: `cluster.shm: 2Gi`); with Docker do not mount /dev/shm read-only "
    "and use `--ipc=host` or `--shm-size=2g`. For NCCL alone, NCCL_SHM_DISABLE=1 avoids "
    "/dev/shm (slower).")
_SHM_ATTACH = (
    "NCCL ranks on one node could not share /dev/shm (separate containers or IPC namespaces)",
    "Ranks of one node exchange data through /dev/shm: run them in one container (or one "
    "pod with a shared emptyDir at /dev/shm), give the containers the same IPC namespace "
    "(`--ipc=host`, hostIPC), or set NCCL_SHM_DISABLE=1 (slower).")
_SIGBUS_TITLE = ("a rank died of SIGBUS (a bus error): in a container this is almost always "
                 "a too small /dev/shm")
_CPU_SET_DEVICE = (
    "torch.cuda.set_device on a CPU-only torch build (no GPU support in this torch)",
    "This torch has no CUDA (a `+cpu` build), so any torch.cuda call fails. To train on "
    "GPUs install a CUDA build of torch; to run the script on CPU guard the GPU-only "
    "lines: `if torch.cuda.is_available(): torch.cuda.set_device(local_rank)`, and choose "
    "the backend in the script: `dist.init_process_group(\"nccl\" if "
    "torch.cuda.is_available() else \"gloo\")`.")
_UNUSED_STATIC = (
    "DDP(static_graph=True) but the graph changed: a parameter used in one iteration was "
    "unused in the next",
    "static_graph=True promises the same parameters take part in every iteration. Drop "
    "static_graph=True (and pass find_unused_parameters=True if some parameters are "
    "sometimes unused), or make forward() use the same parameters every step.")

DEVICE_RULES: tuple[Signature, ...] = (
    # -- no_gpu_visible ----------------------------------------------------------------
    sig("no_gpu_visible", ROOT, r"No CUDA GPUs are available"),
    sig("no_gpu_visible", ROOT, r"invalid device ordinal", *ORDINAL),
    sig("no_gpu_visible", ROOT, r"ProcessGroupNCCL is only supported with GPUs, no GPUs found"),
    sig("no_gpu_visible", ROOT, r"Found no NVIDIA driver on your system|no CUDA-capable "
        r"device is detected|CUDA driver initialization failed"),
    # -- duplicate_gpu -------------------------------------------------------------------
    sig("duplicate_gpu", ROOT,
        r"Duplicate GPU detected ?: rank (?P<hit_rank>\d+) and rank (?P<r2>\d+) both on CUDA "
        r"device (?P<dev>\w+)",
        title="two ranks share one GPU (rank {hit_rank} and rank {r2} are both on device {dev})"),
    # -- version_mismatch ----------------------------------------------------------------
    sig("version_mismatch", ROOT,
        r"Mismatched NCCL version detected ?: rank (?P<r1>\d+) version (?P<v1>\d+) rank "
        r"(?P<r2>\d+) version (?P<v2>\d+)",
        title="ranks run different NCCL versions (rank {r1}: {v1}, rank {r2}: {v2})"),
    sig("version_mismatch", LIKELY,
        r"Message truncated : received (?P<got>\d+) bytes instead of (?P<want>\d+)",
        title="NCCL's bootstrap exchange failed between ranks (received {got} bytes instead "
              "of {want}): the nodes run different NCCL versions",
        exclude=r"NET/Socket"),   # the socket transport's truncation is a network error
    sig("version_mismatch", ROOT,
        r"NVIDIA driver on your system is too old \(found version (?P<found>\d+)\)",
        title="the NVIDIA driver (CUDA {found}) is older than this torch build needs"),
    sig("version_mismatch", ROOT, r"CUDA driver version is insufficient for CUDA runtime version|"
        r"forward compatibility was attempted on non supported HW|system has unsupported "
        r"display driver / cuda driver combination",
        title="the NVIDIA driver is older than the CUDA runtime this torch build uses"),
    sig("version_mismatch", ROOT,
        r"no kernel image is available for execution on the device|with CUDA capability "
        r"sm_\d+ is not compatible with the current PyTorch installation|CUDA error: invalid "
        r"device function|PyTorch no longer supports this GPU because it is too old",
        title="this torch build has no kernels for this GPU's architecture"),
    sig("version_mismatch", ROOT, r"module 'torch\._C' has no attribute '_cuda_\w+'",
        *_CPU_SET_DEVICE),
    sig("version_mismatch", ROOT,
        r"Distributed package doesn't have NCCL built in|Torch not compiled with CUDA enabled",
        *CPU_BUILD),
    sig("version_mismatch", ROOT, r"undefined symbol: (?P<sym>nccl\w+|cu\w+)",
        title="torch and the loaded NCCL/CUDA libraries do not match (undefined symbol {sym})"),
    sig("version_mismatch", ROOT,
        r"lib(?P<lib>nccl|cudart|cublas\w*|cudnn\w*|cuda)\.so[.\d]*: cannot open shared object "
        r"file|cuDNN version incompatibility",
        title="a CUDA/NCCL library this torch build needs is missing or of another version"),
    # -- shm_too_small -------------------------------------------------------------------
    sig("shm_too_small", ROOT, r"unable to open shared memory object.*Too many open files",
        title="DataLoader workers ran out of file descriptors for shared memory",
        fix="Raise the open-file limit (`ulimit -n 65536`, or the container runtime's "
            "nofile limit), or call "
            "torch.multiprocessing.set_sharing_strategy('file_system') before building "
            "the DataLoader."),
    sig("shm_too_small", ROOT,
        r"Call to (?:shm_)?open failed ?: Permission denied|failed to create shared memory "
        r"file \S+, error Permission denied|unable to open shared memory object .*"
        r"Permission denied", *_SHM_PERMISSION),
    sig("shm_too_small", ROOT, r"Error while attaching to shared memory segment", *_SHM_ATTACH),
    sig("shm_too_small", ROOT, r"unable to allocate shared memory\(shm\)|insufficient shared "
        r"memory \(shm\)|is killed by signal: Bus error|workers are out of shared memory"),
    sig("shm_too_small", ROOT, r"Error while creating shared memory segment|failed to extend "
        r"/dev/shm/|posix_fallocate failed|/dev/shm.*No space left on device"),
    sig("shm_too_small", ROOT,
        r"unable to (?:write to|resize|stretch) file </torch_|unable to mmap \d+ bytes from "
        r"file </torch_|unable to open shared memory object </torch_|\$ Torch: unable to mmap "
        r"memory"),
    sig("shm_too_small", RANK,
        r"Signal 7 \(SIGBUS\) received by PID|failed \(exitcode: -7\) local_rank: "
        r"(?P<hit_local>\d+)|process (?P<hit_rank>\d+) terminated with signal SIGBUS|"
        r"died with <Signals\.SIGBUS: 7>|Bus error \(core dumped\)|^Bus error$",
        title=_SIGBUS_TITLE),
    # -- cuda_oom --------------------------------------------------------------------------
    sig("cuda_oom", ROOT, r"CUDA out of memory(?:\. Tried to allocate (?P<req>[\d.]+ [KMGT]?i?B))?"
        r"(?:.*?GPU (?P<gpu>\d+) has a total capacity of (?P<cap>[\d.]+ [KMGT]?i?B))?"),
    sig("cuda_oom", ROOT, r"OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
        r"|Cuda failure '?out of memory"),
    sig("cuda_oom", ROOT, r"\bDevice (?P<dev>\d+) OOM (?P<used>\d+) / (?P<limit>\d+)",
        title="the HAMi vGPU memory limit was exceeded (device {dev} needed {used}, limit {limit})"),
    # -- DDP misuse ------------------------------------------------------------------------
    sig("unused_parameters", ROOT,
        r"Expected to have finished reduction in the prior iteration before starting a new "
        r"one\. This error indicates that your training graph has changed", *_UNUSED_STATIC),
    sig("unused_parameters", ROOT,
        r"Expected to have finished reduction (?:in|from) the prior iteration",  # guide: from
        follow=(r"Parameter indices which did not receive grad for rank \d+: (?P<indices>.*)",
                r"Parameters which did not receive grad for rank (?P<hit_rank>\d+): "
                r"(?P<names>.*)")),
    # the later sentences of the same message: a paste that kept only its tail
    sig("unused_parameters", ROOT,
        r"Parameters which did not receive grad for rank (?P<hit_rank>\d+): (?P<names>.*)|"
        r"Parameter indices which did not receive grad for rank (?P<rank_i>\d+): "
        r"(?P<indices>.*)"),
    sig("unused_parameters", ROOT,
        r"your module has parameters that were not used in producing loss|making sure all "
        r"`forward` function outputs participate in calculating loss|wasn't able to locate "
        r"the output tensors in the return value of your module's `forward` function|"
        r"which particular parameters did not receive gradient on this rank"),
    sig("ddp_mark_ready_twice", ROOT, r"Expected to mark a variable ready only once|"
        r"has been marked as ready twice",
        follow=(r"Parameter at index \d+ with name (?P<param>\S+) has been marked as ready",)),
    sig("ddp_model_mismatch", ROOT,
        r"DDP expects same model across all ranks|appears not to match (?:sizes|strides) of "
        r"the same param in process 0"),
    # -- a checkpoint of another model: torch's Module.load_state_dict (nn/modules/module.py)
    # and disttrain's own resume check (train/ckpt_compat.py) --------------------------------
    sig("checkpoint_mismatch", ROOT,
        r"Error\(s\) in loading state_dict for (?P<module>[\w.]+)|"
        r"resume: (?P<ckpt>\S+) does not fit this model: (?P<ckpt_diff>.*?)(?:; it was saved|$)",
        follow=(r"Missing key\(s\) in state_dict: (?P<missing>.*)",
                r"Unexpected key\(s\) in state_dict: (?P<unexpected>.*)",
                r"size mismatch for (?P<mismatch>[^:\s]+): copying a param with shape "
                r"torch\.Size\((?P<saved>\[[^\]]*\])\) from checkpoint, the shape in current "
                r"model is torch\.Size\((?P<current>\[[^\]]*\])\)")),
)

DEATH_RULES: tuple[Signature, ...] = (
    # -- cpp_abort: a rank's own death, as a SIGKILL is (demoted when it follows the
    # rank's own Python exception: the interpreter then aborts while tearing down) ---------
    sig("cpp_abort", RANK, r"terminate called without an active exception"),
    # -- worker_killed -----------------------------------------------------------------------
    sig("worker_killed", CONSEQUENCE, r"DataLoader worker \(pid\(s\) [\d, ]+\) exited "
        r"unexpectedly",
        title="a DataLoader worker process died (its own error is lost)",
        fix="Re-run with num_workers=0 to see the worker's own error. Common causes: a too "
            "small /dev/shm (bus error) and the memory limit (the worker was killed)."),
    sig("worker_killed", RANK,
        r"Signal 9 \(SIGKILL\) received by PID|failed \(exitcode: -9\) local_rank: "
        r"(?P<hit_local>\d+)|process (?P<hit_rank>\d+) terminated with signal SIGKILL|"
        r"\bOOMKilled\b|Exit Code:\s+137\b|is killed by signal: Killed|^Killed$"),
)
