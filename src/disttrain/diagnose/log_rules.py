"""The failure signatures `disttrain doctor logs` knows, built from real PyTorch/NCCL text.

Every pattern below is a message that torch (2.1 … 2.13), NCCL, gloo, CUDA or HAMi-core
really prints; tests/diagnose/logs/README.md says where each fixture's text came from.
Each signature has a strength, because a failed job usually shows several errors and
only one of them is the cause:

    ROOT (4)       names a cause on its own (CUDA OOM, port in use, DDP misuse, ...);
    LIKELY (3)     usually the cause, but can follow another failure (rendezvous, NCCL
                   interface/connect errors);
    RANK (2)       a rank died (its own exception, SIGKILL); the root cause when
                   nothing stronger is seen;
    CONSEQUENCE (1) what the *other* ranks report once one rank is gone: "Connection
                   closed by peer", watchdog / gloo timeouts, closed rendezvous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROOT, LIKELY, RANK, CONSEQUENCE = 4, 3, 2, 1

# id -> (default title, default fix). Titles and fixes may use {name} fields filled from
# the matched message's named groups; FIELD_DEFAULTS covers the ones a message lacked.
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
        "`nvidia.com/gpu: N` in resources.limits (seed 000 §8.2); check `nvidia-smi` in the "
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
        "workers (`python -m disttrain.worker` does). Otherwise take the native stack "
        "(`gdb -p PID`, or a core dump with `ulimit -c unlimited`) and report it with the "
        "torch version."),
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
                  "exc_type": "Exception", "exc_msg": "", "where": "see the traceback"}


@dataclass(frozen=True)
class Signature:
    """One real message: which cause it means, how strongly, and a sharper title/fix."""

    cause: str
    strength: int
    pattern: re.Pattern[str]
    title: str | None = None
    fix: str | None = None
    exclude: re.Pattern[str] | None = None
    # lines shortly after the match that add detail (e.g. which parameters got no grad)
    follow: tuple[re.Pattern[str], ...] = field(default_factory=tuple)


def _sig(cause: str, strength: int, pattern: str, title: str | None = None,
         fix: str | None = None, exclude: str | None = None, follow: tuple[str, ...] = (),
         flags: int = 0) -> Signature:
    return Signature(cause, strength, re.compile(pattern, flags), title, fix,
                     re.compile(exclude) if exclude else None,
                     tuple(re.compile(f) for f in follow))


_NCCL_LINE = r"NCCL (?:INFO|WARN)"
_IFNAME_FIX = (
    "{var} names an interface this machine does not have. `ip -4 addr` (or `disttrain "
    "doctor`) lists the interfaces; name the one carrying the pod/node IP (usually eth0 in "
    "a pod) or unset the variable so NCCL picks one (it skips lo and docker*). "
    "GLOO_SOCKET_IFNAME takes one concrete name, not NCCL's ^exclude syntax.")
_PEER_LOST_TITLE = ("a rank lost its connection to another rank (that rank exited, or the "
                    "network dropped)")
_PEER_LOST_FIX = (
    "This is usually a consequence: find the rank that failed first (the other ranks' logs, "
    "torchrun's 'Root Cause' block, `disttrain doctor logs` on the whole job's log) and fix "
    "that. If every rank was healthy, the network between nodes dropped: check "
    "NCCL_SOCKET_IFNAME, the MTU and firewalls.")
_CPU_BUILD = ("this torch build has no CUDA/NCCL (a CPU-only build)",
              "Install a CUDA build of torch (e.g. the guide's "
              "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime image) to use GPUs and NCCL, or "
              "train on CPU with the gloo backend (`--backend gloo`).")
_ORDINAL = ("a rank asked for a GPU index that does not exist (invalid device ordinal)",
            "Usually more processes than visible GPUs (--nproc-per-node > nvidia.com/gpu), or "
            "the global RANK used as the device index in a multi-node job. Use "
            "`torch.cuda.set_device(int(os.environ['LOCAL_RANK']))` and "
            "DDP(device_ids=[local_rank]), with nproc_per_node <= GPUs per pod.")

SIGNATURES: tuple[Signature, ...] = (
    # -- port_in_use (seed 000 §8.3) --------------------------------------------------
    _sig("port_in_use", ROOT,
         r"server socket has failed to listen on any local network address"
         r"(?:.*?port: (?P<port>\d+))?"),
    _sig("port_in_use", ROOT, r"EADDRINUSE|Address already in use|address already in use",
         exclude=_NCCL_LINE),  # NCCL's own "bind failed" chatter is retried and harmless
    # -- no_gpu_visible (§8.2) ---------------------------------------------------------
    _sig("no_gpu_visible", ROOT, r"No CUDA GPUs are available"),
    _sig("no_gpu_visible", ROOT, r"invalid device ordinal", *_ORDINAL),
    _sig("no_gpu_visible", ROOT, r"ProcessGroupNCCL is only supported with GPUs, no GPUs found"),
    _sig("no_gpu_visible", ROOT, r"Found no NVIDIA driver on your system|no CUDA-capable "
         r"device is detected|CUDA driver initialization failed"),
    # -- duplicate_gpu -------------------------------------------------------------------
    _sig("duplicate_gpu", ROOT,
         r"Duplicate GPU detected ?: rank (?P<hit_rank>\d+) and rank (?P<r2>\d+) both on CUDA "
         r"device (?P<dev>\w+)",
         title="two ranks share one GPU (rank {hit_rank} and rank {r2} are both on device {dev})"),
    # -- version_mismatch ----------------------------------------------------------------
    _sig("version_mismatch", ROOT,
         r"Mismatched NCCL version detected ?: rank (?P<r1>\d+) version (?P<v1>\d+) rank "
         r"(?P<r2>\d+) version (?P<v2>\d+)",
         title="ranks run different NCCL versions (rank {r1}: {v1}, rank {r2}: {v2})"),
    _sig("version_mismatch", ROOT,
         r"NVIDIA driver on your system is too old \(found version (?P<found>\d+)\)",
         title="the NVIDIA driver (CUDA {found}) is older than this torch build needs"),
    _sig("version_mismatch", ROOT, r"CUDA driver version is insufficient for CUDA runtime version",
         title="the NVIDIA driver is older than the CUDA runtime this torch build uses"),
    _sig("version_mismatch", ROOT,
         r"no kernel image is available for execution on the device|with CUDA capability "
         r"sm_\d+ is not compatible with the current PyTorch installation",
         title="this torch build has no kernels for this GPU's architecture"),
    _sig("version_mismatch", ROOT,
         r"Distributed package doesn't have NCCL built in|Torch not compiled with CUDA enabled",
         *_CPU_BUILD),
    _sig("version_mismatch", ROOT, r"undefined symbol: (?P<sym>nccl\w+|cu\w+)",
         title="torch and the loaded NCCL/CUDA libraries do not match (undefined symbol {sym})"),
    # -- shm_too_small -------------------------------------------------------------------
    _sig("shm_too_small", ROOT, r"unable to allocate shared memory\(shm\)|insufficient shared "
         r"memory \(shm\)|is killed by signal: Bus error"),
    _sig("shm_too_small", ROOT, r"Error while creating shared memory segment|failed to extend "
         r"/dev/shm/|posix_fallocate failed|/dev/shm.*No space left on device"),
    _sig("shm_too_small", ROOT, r"unable to open shared memory object.*Too many open files",
         title="DataLoader workers ran out of file descriptors for shared memory",
         fix="Raise the open-file limit (`ulimit -n 65536`, or the container runtime's "
             "nofile limit), or call "
             "torch.multiprocessing.set_sharing_strategy('file_system') before building "
             "the DataLoader."),
    # -- cuda_oom (§8.5) -------------------------------------------------------------------
    _sig("cuda_oom", ROOT, r"CUDA out of memory(?:\. Tried to allocate (?P<req>[\d.]+ [KMGT]?i?B))?"
         r"(?:.*?GPU (?P<gpu>\d+) has a total capacity of (?P<cap>[\d.]+ [KMGT]?i?B))?"),
    _sig("cuda_oom", ROOT, r"OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
         r"|Cuda failure '?out of memory"),
    _sig("cuda_oom", ROOT, r"\bDevice (?P<dev>\d+) OOM (?P<used>\d+) / (?P<limit>\d+)",
         title="the HAMi vGPU memory limit was exceeded (device {dev} needed {used}, limit {limit})"),
    # -- DDP misuse ------------------------------------------------------------------------
    _sig("unused_parameters", ROOT,
         r"Expected to have finished reduction (?:in|from) the prior iteration",  # guide: from
         follow=(r"Parameter indices which did not receive grad for rank \d+: (?P<indices>.*)",
                 r"Parameters which did not receive grad for rank (?P<hit_rank>\d+): "
                 r"(?P<names>.*)")),
    _sig("ddp_mark_ready_twice", ROOT, r"Expected to mark a variable ready only once|"
         r"has been marked as ready twice",
         follow=(r"Parameter at index \d+ with name (?P<param>\S+) has been marked as ready",)),
    _sig("ddp_model_mismatch", ROOT,
         r"DDP expects same model across all ranks|appears not to match (?:sizes|strides) of "
         r"the same param in process 0"),
    # -- nccl_network_error ----------------------------------------------------------------
    _sig("nccl_network_error", LIKELY, r"Unable to find address for: (?P<ifname>\S+)",
         title="GLOO_SOCKET_IFNAME names an interface that does not exist here ({ifname})",
         fix=_IFNAME_FIX.format(var="GLOO_SOCKET_IFNAME")),
    _sig("nccl_network_error", LIKELY,
         r"Bootstrap : no socket interface found|no NCCL_SOCKET_IFNAME interface found|"
         r"ncclSocketInit: connecting to address .*is neither AF_INET",
         title="NCCL found no usable network interface (check NCCL_SOCKET_IFNAME)",
         fix=_IFNAME_FIX.format(var="NCCL_SOCKET_IFNAME")),
    _sig("nccl_network_error", LIKELY,
         r"socketStartConnect: Connect to (?P<addr>\S+) failed|WARN Call to connect failed|"
         r"socketPollConnect",
         title="NCCL could not connect to another rank ({addr})"),
    _sig("nccl_network_error", LIKELY, r"NET/IB : Got completion from peer .* with error",
         title="InfiniBand transport error between ranks",
         fix="Check the IB fabric (`ibstat`, NCCL_IB_HCA), or fall back to TCP sockets with "
             "NCCL_IB_DISABLE=1."),
    _sig("nccl_network_error", RANK, r"unhandled system error|ncclSystemError",
         exclude=r"shared memory"),
    _sig("nccl_network_error", CONSEQUENCE,
         r"ncclRemoteError|remote process exiting prematurely|Connection closed by (?:remote )?"
         r"peer|Connection reset by peer|connection reset by peer|failed : Broken pipe",
         _PEER_LOST_TITLE, _PEER_LOST_FIX),
    # -- rendezvous_failure ----------------------------------------------------------------
    _sig("rendezvous_failure", LIKELY,
         r"gai error: -?\d+ - |socket\.gaierror|Temporary failure in name resolution|"
         r"Name or service not known",
         title="a host name (MASTER_ADDR or the rendezvous endpoint) does not resolve",
         exclude=r"urlopen|URLError|HTTPS?Connection|Max retries|https?://"),  # downloads
    _sig("rendezvous_failure", LIKELY,
         r"client socket has timed out after \S+ while trying to connect to \((?P<addr>[^,]+), "
         r"(?P<port>\d+)\)|client socket has failed to connect to (?:any network address of )?"
         r"\(?(?P<addr2>[^,)\s]+)",
         title="could not connect to the master's store at {addr}:{port}"),
    _sig("rendezvous_failure", LIKELY,
         r"waiting for clients\. (?P<joined>\d+)/(?P<expected>\d+) clients joined",
         title="only {joined} of {expected} processes joined (world size mismatch or a "
               "worker never started)",
         fix="WORLD_SIZE (--nnodes x --nproc-per-node) must equal the number of processes "
             "that actually start: check every node's torchrun arguments and that every "
             "pod was scheduled (`kubectl get pods`)."),
    _sig("rendezvous_failure", LIKELY,
         r"environment variable (?P<var>[A-Z_]+) expected, but not set",
         title="the rendezvous environment is incomplete ({var} is not set)",
         fix="Launch with torchrun (or `disttrain run`), which sets MASTER_ADDR, MASTER_PORT, "
             "RANK and WORLD_SIZE; an mp.spawn script must set MASTER_ADDR and MASTER_PORT "
             "itself before spawning (or pass init_method='tcp://HOST:PORT')."),
    _sig("rendezvous_failure", LIKELY, r"RendezvousTimeoutError|RendezvousConnectionError|"
         r"Socket Timeout\b"),
    _sig("rendezvous_failure", CONSEQUENCE, r"RendezvousClosedError",
         title="the rendezvous was closed (another node failed, or the job is shutting down)"),
    # -- collective_timeout ----------------------------------------------------------------
    # disttrain's own stall watchdog (disttrain.resilience.watchdog) names the rank that stopped
    # (`subject_rank`: the rank the line is about, whichever rank printed it): it
    # is the root cause of the timeouts and "connection closed" errors the others print.
    _sig("collective_timeout", ROOT,
         r"ranks? (?P<subject_rank>\d+)(?:,[\d, ]+)? \(pids? [^)]*\) made no progress for "
         r"(?P<secs>[\d.]+) ?s; last seen: (?P<where>[^;\n]+)",
         title="rank {subject_rank} stalled: no progress for {secs} s (last seen: {where})",
         fix="That rank stopped making progress (SIGSTOPped, deadlocked, stuck in I/O, or "
             "waiting in a collective the others never entered). `py-spy dump --pid PID` "
             "shows where it is; check what it does at the last-seen step and phase (rank-0-"
             "only work without a barrier, uneven data, a hung filesystem). --timeout-s sets "
             "how long a rank may stall before the job is ended."),
    _sig("collective_timeout", CONSEQUENCE,
         r"Watchdog caught collective operation timeout(?:: WorkNCCL\(.*?OpType=(?P<op>\w+))?"),
    _sig("collective_timeout", CONSEQUENCE,
         r"Timed out waiting \d+ms for (?:recv|send) operation|Some NCCL operations have "
         r"failed or timed out|watchdog got stuck for \d+ seconds|timed out in "
         r"monitoredBarrier|failed to pass monitoredBarrier|NCCL timeout"),
    # -- cpp_abort: a rank's own death, as a SIGKILL is -------------------------------------
    _sig("cpp_abort", RANK, r"terminate called without an active exception"),
    # -- worker_killed -----------------------------------------------------------------------
    _sig("worker_killed", CONSEQUENCE, r"DataLoader worker \(pid\(s\) [\d, ]+\) exited "
         r"unexpectedly",
         title="a DataLoader worker process died (its own error is lost)",
         fix="Re-run with num_workers=0 to see the worker's own error. Common causes: a too "
             "small /dev/shm (bus error) and the memory limit (the worker was killed)."),
    _sig("worker_killed", RANK,
         r"Signal 9 \(SIGKILL\) received by PID|failed \(exitcode: -9\) local_rank: "
         r"(?P<hit_local>\d+)|process (?P<hit_rank>\d+) terminated with signal SIGKILL|"
         r"\bOOMKilled\b|Exit Code:\s+137\b|is killed by signal: Killed|^Killed$"),
)


def leading_literals(pattern: str) -> list[str] | None:
    """The literal text each top-level alternative of `pattern` must start with.

    A line can only match when it contains one of them, so a plain substring search over
    the whole log finds the few lines worth running the regexes on. None when some
    alternative starts with no literal of three or more characters.
    """
    branches, depth, cur, i = [], 0, "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            cur += pattern[i:i + 2]
            i += 2
            continue
        depth += c == "("
        depth -= c == ")"
        if c == "|" and depth == 0:
            branches.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    branches.append(cur)
    out = []
    for branch in branches:
        lit = _literal_prefix(branch)
        if len(lit) < 3:
            return None
        out.append(lit)
    return out


def _literal_prefix(branch: str) -> str:
    b = branch.removeprefix("^")
    b = b[2:] if b.startswith("\\b") else b
    lit, i = "", 0
    while i < len(b):
        c = b[i]
        if c == "\\":
            if i + 1 < len(b) and not b[i + 1].isalnum():
                lit += b[i + 1]
                i += 2
                continue
            break
        if c in ".^$*+?{}[]|()":
            if c in "*?{" and lit:   # the last character is optional or repeated
                lit = lit[:-1]
            break
        lit += c
        i += 1
    return lit


NEEDLES: tuple[str, ...] = tuple(sorted({
    lit for s in SIGNATURES for lit in (leading_literals(s.pattern.pattern) or [])}))
# signatures without needles are tried on every line (none today; a test keeps it so)
UNFILTERED: tuple[Signature, ...] = tuple(
    s for s in SIGNATURES if s.pattern.flags & re.IGNORECASE
    or leading_literals(s.pattern.pattern) is None)

# A line that says something failed (used to tell "unknown" from "none").
FAILURE_SIGNAL = re.compile(
    r"Traceback \(most recent call last\)|ChildFailedError|\bFAILED\b|Segmentation fault|"
    r"core dumped|exitcode\s*:\s*-?[1-9]|[Ee]xit code:?\s*-?[1-9]|^Killed$|"
    r"\b(?:ERROR|FATAL|CRITICAL)\b|\b\w*(?:Error|Exception)\b:|\bpanic:|\bfailed\b|"
    r"\bfailure\b|\bAborted\b")
# A line that looks like training output (a clean log of a real run says "none").
TRAINING_MARKER = re.compile(
    r"\b(?:loss|epoch|step|accuracy|acc|iter(?:ation)?|samples/s|train(?:ing)?|rank\d*|"
    r"world[_ ]size|NCCL|torchrun|disttrain)\b", re.IGNORECASE)
# Exceptions that are wrappers or the launcher's own reaction, never a root cause.
WRAPPER_EXCEPTIONS = re.compile(
    r"(?:^|\.)(?:ChildFailedError|ProcessRaisedException|ProcessExitedException|"
    r"SignalException|KeyboardInterrupt|SystemExit)$")
WRAPPER_MESSAGES = re.compile(r"^Caught \w+ in DataLoader worker process \d+")
