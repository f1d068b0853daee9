"""The torchrun command line for a JobSpec, as a pure function.

    torchrun_argv(spec)    # ['torchrun', '--nproc_per_node=2', '-m', 'disttrain.worker',
                           #  '--spec', 'job.yaml']

Options are only given where they differ from torchrun's defaults (no `--nnodes` for one
node, no `--master_port` for 29500). Both the local launcher's `--dry-run`
(`disttrain run`) and the Kubernetes renderer (`disttrain.k8s.render`) use this, so what
runs in a pod is what `disttrain run` shows. Kept apart from the launchers so the renderer
does not import torch.
"""

from __future__ import annotations

from disttrain.launch.devices import local_gpu_count
from disttrain.spec.job import JobSpec


def resolve_nproc(spec: JobSpec, gpus: int | None = None) -> int:
    """`auto` -> one process per GPU, else 2 (the CPU demo: gloo over 2 processes).

    The built-in job's strategy `dp` is the exception: nn.DataParallel is one process
    driving all visible GPUs, so `auto` means 1; with 2 processes both fail. A user
    script ignores `train`, so its `auto` stays as above.

    Args:
        spec: the job.
        gpus: the GPUs per node to plan for (a pod's `cluster.gpus`); default: this
            machine's (`devices.local_gpu_count`), the one impure step here.
    """
    n = spec.launch.nproc_per_node
    if n != "auto":
        return int(n)
    if spec.train.strategy == "dp" and not spec.script:
        return 1
    gpus = local_gpu_count() if gpus is None else gpus
    return gpus if gpus >= 1 else 2


# Seconds the nodes of a multi-node job have to meet when launch.rdzv_timeout_s is unset:
# torchrun's own 600 s lets the ranks of a half-started job hold their GPU slices for ten
# minutes while the missing pods wait for room (docs/cluster.md, "All pods or none").
DEFAULT_RDZV_TIMEOUT_S = 180


def rdzv_timeout_s(spec: JobSpec) -> int | None:
    """The rendezvous deadline of `spec`: launch.rdzv_timeout_s, else 180 s with several
    nodes; None for one node (nothing to wait for)."""
    if spec.launch.rdzv_timeout_s is not None:
        return spec.launch.rdzv_timeout_s
    return DEFAULT_RDZV_TIMEOUT_S if spec.launch.nnodes > 1 else None


# the entry that runs a user script with its optimizer steps as heartbeat (kept as a string:
# this module stays free of the resilience package)
SCRIPT_ENTRY = "disttrain.resilience.script_heartbeat"


def worker_command(spec: JobSpec, spec_path: str = "job.yaml", script_entry: bool = False,
                   live_dir: str | None = None) -> list[str]:
    """What each worker runs: the user's script, or the built-in job reading `spec_path`.

    With `script_entry` a script runs through `python -m disttrain.resilience.script_heartbeat`
    (needs disttrain where it runs), which is `python script.py` plus a heartbeat from its
    process group, optimizer steps, forwards and collectives, so the stall watchdog covers an
    unmodified script (docs/resilience.md); with `live_dir` (the run dir) it also writes the
    live files there (docs/monitoring.md).
    """
    if spec.script and script_entry:
        live = [f"--run-dir={live_dir}"] if live_dir else []
        return ["-m", SCRIPT_ENTRY, f"--timeout-s={spec.launch.timeout_s:g}", *live, spec.script,
                *spec.args]
    if spec.script:
        return [spec.script, *spec.args]
    return ["-m", "disttrain.worker", "--spec", spec_path, *spec.args]


def torchrun_argv(
    spec: JobSpec,
    *,
    nproc: int | None = None,
    node_rank: str | int | None = None,
    rdzv_endpoint: str | None = None,
    program: str = "torchrun",
    spec_path: str = "job.yaml",
    script_entry: bool = False,
) -> list[str]:
    """The torchrun invocation for `spec` (multi-node: c10d rendezvous at `rdzv_endpoint`).

    Args:
        spec: the job.
        nproc: processes per node (default: `resolve_nproc(spec)`).
        node_rank: this node's rank, or a shell expression such as `$(JOB_COMPLETION_INDEX)`.
        rdzv_endpoint: host:port of the c10d rendezvous; default master_addr:master_port.
        program: the launcher executable (`torchrun` in pods).
        spec_path: where the built-in worker finds the job spec (ignored for scripts).
        script_entry: run a script through the heartbeat entry (`worker_command`).

    Returns:
        argv: program, torchrun options, then the worker command.
    """
    launch = spec.launch
    nproc = resolve_nproc(spec) if nproc is None else nproc
    # Options are spelled as in the guide (`--nproc_per_node=2`) and only given when they
    # differ from torchrun's defaults, so the guide's Pod command is reproduced exactly.
    argv = [program]
    if launch.nnodes != 1:
        argv.append(f"--nnodes={launch.nnodes}")
    argv.append(f"--nproc_per_node={nproc}")
    if launch.nnodes == 1 and rdzv_endpoint is None:
        if launch.master_addr not in ("127.0.0.1", "localhost"):
            argv.append(f"--master_addr={launch.master_addr}")
        if launch.master_port != 29500:
            argv.append(f"--master_port={launch.master_port}")
    else:
        endpoint = rdzv_endpoint or launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}"
        argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                 f"--rdzv_id={launch.rdzv_id or spec.name}"]
        deadline = rdzv_timeout_s(spec)
        if deadline is not None:  # c10d's own join deadline (torch's default 600 s)
            argv.append(f"--rdzv_conf=join_timeout={deadline}")
        if node_rank is not None:
            argv.append(f"--node_rank={node_rank}")
    if launch.max_restarts:
        argv.append(f"--max_restarts={launch.max_restarts}")
    return argv + worker_command(spec, spec_path, script_entry)
