"""What each cause of a failed job means, and what to change: the doctor's vocabulary.

`CAUSES` maps every cause id `disttrain doctor logs` can answer to a default title and
fix; a signature (log_rules_*) may carry a sharper pair, and `log_advice` tailors the fix
to the launcher and backend the log shows. Titles and fixes may use {name} fields filled
from the matched message's named groups; FIELD_DEFAULTS covers the ones a message lacked.
"""

from __future__ import annotations

CAUSES: dict[str, tuple[str, str]] = {
    "port_in_use": (
        "the master port{port_txt} is already in use",
        "Another process listens on port {port} (often an earlier job still running, or two "
        "jobs on one node). Find it with `ss -ltnp | grep {port}` and stop it, or pick "
        "another port: `export MASTER_PORT=29501` / `torchrun --master-port 29501`; on one "
        "node `torchrun --standalone` (or `disttrain run --master-port 0`) picks a free one."),
    "nccl_network_error": (
        "communication between ranks failed (NCCL/gloo network error)",
        "Run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see the interface and "
        "addresses NCCL uses. Point NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) at the "
        "interface that carries the pod/node IPs (usually eth0 in a pod; `ip -4 addr`), "
        "allow traffic between the nodes (firewall, NetworkPolicy), and set "
        "NCCL_IB_DISABLE=1 where there is no InfiniBand. `disttrain doctor` checks the "
        "interface name."),
    "no_gpu_visible": (
        "no usable GPU for this rank",
        "On the HAMi cluster the pod needs `schedulerName: hami-scheduler` and "
        "`nvidia.com/gpu: N` in resources.limits (deployment guide §8.2); check `nvidia-smi` in the "
        "pod and `disttrain doctor --gpus N`. Start at most as many processes per pod as "
        "GPUs (--nproc-per-node <= nvidia.com/gpu), bind each to LOCAL_RANK "
        "(`torch.cuda.set_device(local_rank)`), and do not override CUDA_VISIBLE_DEVICES / "
        "NVIDIA_VISIBLE_DEVICES. Without GPUs use the gloo backend."),
    "unused_parameters": (
        "DDP: some parameters received no gradient (unused parameters)",
        "forward() does not use every parameter on every step (an unused head, a branch "
        "taken only sometimes, outputs left out of the loss). Make every parameter take part "
        "in the loss, delete unused submodules, or pass `find_unused_parameters=True` to "
        "DistributedDataParallel (slightly slower); TORCH_DISTRIBUTED_DEBUG=INFO names the "
        "parameters. The guide's §8.4 fix (sampler.set_epoch) does not address this error."),
    "ddp_mark_ready_twice": (
        "DDP: a parameter was marked ready twice in one backward (reentrant checkpointing "
        "or shared parameters)",
        "The same parameters took part in several reentrant backward passes: typically "
        "torch.utils.checkpoint(use_reentrant=True) around a module that is reused, or a "
        "parameter used outside forward(). Use `checkpoint(..., use_reentrant=False)`, or "
        "pass `static_graph=True` to DistributedDataParallel if the graph is the same every "
        "iteration; do not combine find_unused_parameters=True with reentrant checkpointing."),
    "ddp_model_mismatch": (
        "DDP: the ranks built different models",
        "Every rank must build the identical model (same layers, shapes and order) before "
        "DDP wraps it. Look for rank-dependent construction: a config read differently per "
        "rank, layers created under `if rank == 0`, different checkpoints, or random "
        "architecture choices without a shared seed."),
    "checkpoint_mismatch": (
        "the checkpoint was saved from another model{ckpt_detail}",
        "The checkpoint being loaded belongs to a different model (other layers or sizes): "
        "load a checkpoint of this model, or build the model the checkpoint was saved from. "
        "With `disttrain run`: train this model into another run dir (--run-dir or --name) "
        "or start without --resume. Keys that differ only by a 'module.' prefix come from "
        "a DDP wrapper's state_dict: save `model.module.state_dict()` (disttrain lint's "
        "DT017) or load into `model.module`."),
    "cuda_oom": (
        "GPU out of memory{detail}",
        "Lower the per-GPU batch size (keep the global batch with gradient accumulation), use "
        "bf16/fp16 autocast, enable gradient checkpointing, or shard the model with FSDP. "
        "Under HAMi the limit is the vGPU slice (`nvidia.com/gpumem`, CUDA_DEVICE_MEMORY_LIMIT_i "
        "in the container), shared by every process of the container: raise gpumem or run "
        "fewer processes per GPU. If much memory is reserved but unallocated, set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."),
    "collective_timeout": (
        "a collective operation timed out (a rank stopped taking part or was too slow)",
        "{stragglers}One rank did not reach the same collective: it failed earlier (look for "
        "its error), it is busy with rank-0-only work (evaluation, checkpoint saving, "
        "downloads) while the others wait, or ranks run a different number of steps "
        "(uneven data). Make every rank call the same collectives in the same order, put "
        "a dist.barrier() after rank-0-only work, and give init_process_group(timeout=...) "
        "room for slow steps. TORCH_DISTRIBUTED_DEBUG=DETAIL shows each rank's collective."),
    "rendezvous_failure": (
        "the ranks could not meet (rendezvous / TCPStore failure)",
        "Workers could not reach the master's store at MASTER_ADDR:MASTER_PORT. Check that "
        "MASTER_ADDR resolves in every pod (a headless Service must exist; DNS can lag while "
        "pods start), that the master pod runs and listens on the port, that no firewall or "
        "NetworkPolicy blocks it, and that every node uses the same --nnodes, "
        "--nproc-per-node and rendezvous id. Start the master first or raise the rendezvous "
        "timeout; `disttrain doctor` checks MASTER_ADDR and MASTER_PORT."),
    "worker_killed": (
        "a worker was killed (SIGKILL, exit code -9), most often by the out-of-memory killer",
        "No Python error means the kernel killed the process: usually the container's or "
        "host's memory limit (`kubectl describe pod` shows OOMKilled; `dmesg` shows the OOM "
        "killer). Raise resources.limits.memory, lower DataLoader num_workers/prefetch and "
        "in-memory datasets, load checkpoints with map_location='cpu'. A kill from outside "
        "(preemption, `kubectl delete`) looks the same."),
    "cpp_abort": (
        "a rank aborted in C++: std::terminate with no exception (SIGABRT)",
        "A C++ thread object was destroyed while its thread still ran. When the log shows "
        "the run had finished (final metrics before the abort, no Python frame in the "
        "dump), the process group was still alive in interpreter teardown: with torch "
        "2.13 it outlives destroy_process_group when torch._dynamo was first imported "
        "after init_process_group (every optimizer imports it), and gloo's threads still "
        "run while C++ static objects are destroyed. End a finished worker with "
        "`os._exit(code)` after flushing its files and streams, as multiprocessing ends its "
        "workers (`python -m disttrain.worker` and the script ranks of `disttrain run "
        "script.py` do: docs/resilience.md, \"How a process ends\"). Otherwise take the "
        "native stack (`gdb -p PID`, or a core dump with `ulimit -c unlimited`) and report "
        "it with the torch version."),
    "duplicate_gpu": (
        "two ranks share one GPU (NCCL: Duplicate GPU detected)",
        "Each NCCL rank needs its own GPU. Bind rank to device with LOCAL_RANK "
        "(`torch.cuda.set_device(local_rank)` before init_process_group), start no more "
        "processes per pod than `nvidia.com/gpu`, and under HAMi do not place several ranks "
        "on vGPU slices of one card: `nvidia.com/gpu: N` in one pod gives N distinct physical "
        "GPUs, while separate gpumem-limited pods may share a card."),
    "version_mismatch": (
        "incompatible CUDA driver / NCCL / torch builds",
        "Use one image (same torch, CUDA and NCCL) on every node; `disttrain env` in each pod "
        "shows the versions. The node's driver must support the CUDA version torch was built "
        "with (`nvidia-smi` shows the driver's CUDA version; torch.version.cuda must not be "
        "newer), and the torch build must have kernels for the GPU's architecture."),
    "shm_too_small": (
        "/dev/shm is too small (shared memory for DataLoader workers / NCCL)",
        "Give the container a bigger /dev/shm: in Kubernetes mount an emptyDir "
        "`{{medium: Memory, sizeLimit: 2Gi}}` at /dev/shm (disttrain: `cluster.shm: 2Gi`); with "
        "Docker `--shm-size=2g` (the default is 64 MiB). Or lower DataLoader num_workers (0 "
        "uses no shared memory), or set NCCL_SHM_DISABLE=1 for NCCL (slower)."),
    "user_code_error": (
        "{exc_type} in the training script: {exc_msg}",
        "Fix this exception in your code ({where}). The errors other ranks report afterwards "
        "(connection closed by peer, timeouts) are consequences of this rank exiting."),
    "none": (
        "no failure found in the log",
        "Nothing to fix: the log shows no error. If the job still misbehaved, look at the "
        "complete log of every rank, or run `disttrain doctor` on the machine."),
    "unknown": (
        "a failure is visible but matches no known cause",
        "Read the first error in the log (the earliest traceback; the 'Root Cause' rank in "
        "torchrun's summary). Re-run with NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=INFO "
        "for more detail, and run `disttrain doctor` on the machine."),
}

FIELD_DEFAULTS = {"port": "$MASTER_PORT", "port_txt": "", "addr": "MASTER_ADDR", "detail": "",
                  "stragglers": "", "var": "NCCL_SOCKET_IFNAME", "ifname": "?",
                  "exc_type": "Exception", "exc_msg": "", "where": "see the traceback",
                  "ckpt_detail": ""}


# Texts that several signatures share.
NCCL_LINE = r"NCCL (?:INFO|WARN)"
IFNAME_FIX = (
    "{var} names an interface this machine does not have. `ip -4 addr` (or `disttrain "
    "doctor`) lists the interfaces; name the one carrying the pod/node IP (usually eth0 in "
    "a pod) or unset the variable so NCCL picks one (it skips lo and docker*). "
    "GLOO_SOCKET_IFNAME takes one concrete name, not NCCL's ^exclude syntax.")
PEER_LOST_TITLE = ("a rank lost its connection to another rank (that rank exited, or the "
                    "network dropped)")
PEER_LOST_FIX = (
    "This is usually a consequence: find the rank that failed first (the other ranks' logs, "
    "torchrun's 'Root Cause' block, `disttrain doctor logs` on the whole job's log) and fix "
    "that. If every rank was healthy, the network between nodes dropped: check "
    "NCCL_SOCKET_IFNAME, the MTU and firewalls.")
CPU_BUILD = ("this torch build has no CUDA/NCCL (a CPU-only build)",
             "Install a CUDA build of torch (e.g. the "
             "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime image) to use GPUs and NCCL. To "
             "run on CPU, the backend must change where it is chosen: a script that calls "
             "`init_process_group(\"nccl\")` needs `init_process_group(\"nccl\" if "
             "torch.cuda.is_available() else \"gloo\")` (a launcher flag cannot change the "
             "script's own choice); disttrain's built-in examples take `--backend gloo`.")
ORDINAL = ("a rank asked for a GPU index that does not exist (invalid device ordinal)",
            "Usually more processes than visible GPUs (--nproc-per-node > nvidia.com/gpu), or "
            "the global RANK used as the device index in a multi-node job. Use "
            "`torch.cuda.set_device(int(os.environ['LOCAL_RANK']))` and "
            "DDP(device_ids=[local_rank]), with nproc_per_node <= GPUs per pod.")

