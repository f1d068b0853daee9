"""What a local launch will do, decided before any process starts: port, env, LaunchConfig.

    plan = make_plan(spec)                    # nproc resolved, a free master port chosen
    os.environ.update(plan.env)               # OMP_NUM_THREADS, the start-up clock
    with agent_scratch() as scratch:          # torch's LaunchConfig for elastic_launch
        config = plan.config("forkserver", scratch_dir=scratch)

    config = launch_config(LaunchSpec(master_port=port), 2, name="test", start_method="forkserver",
                           scratch_dir=scratch)

`disttrain run`, `disttrain verify`, the benchmarks and `disttrain.testing.run_ranks` all
build torch's `LaunchConfig` with `launch_config`, so they rendezvous the same way: static
on one node, c10d on several, the same timeouts and monitor interval. Nothing here
imports torch at module level: `disttrain run` computes the worker env before it imports
torch, so the warm fork server's import overlaps its own.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain import envvars
from disttrain.distributed.process import threads_per_rank
from disttrain.errors import LaunchError, PortTaken, TorchVersionError
from disttrain.launch.argv import DEFAULT_RDZV_TIMEOUT_S, resolve_nproc
from disttrain.launch.ports import free_port, port_free
from disttrain.spec.job import JobSpec, LaunchSpec

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

LOOPBACK = "127.0.0.1"
# How often torch's elastic agent polls its workers: a failure or a stall kill reaches
# the launcher within this, instead of torch's default 5 s.
MONITOR_INTERVAL_S = 0.05


# -- the master port ---------------------------------------------------------------------
def choose_port(spec: JobSpec) -> tuple[int, str | None]:
    """The master port to use and, when it moved, a note saying so.

    Only a port on this machine (one node, loopback) is probed; a remote master's port
    is used as given. Port 0 means any free port.

    Raises:
        LaunchError: an explicitly requested port is taken.
    """
    launch = spec.launch
    local = launch.nnodes == 1 and launch.master_addr in (LOOPBACK, "localhost")
    if not local:
        return launch.master_port, None
    if launch.master_port == 0:
        return free_port(LOOPBACK), None
    if port_free(launch.master_port, LOOPBACK):
        return launch.master_port, None
    if launch.port_explicit:
        raise LaunchError(
            f"master port {launch.master_port} is already in use (Address already in use); "
            f"stop the process holding it (`ss -ltnp | grep {launch.master_port}`) or pass "
            f"another --master-port (0 picks a free one)")
    port = free_port(LOOPBACK)
    return port, f"port {launch.master_port} is in use; using free port {port} instead"


def with_port(spec: JobSpec, port: int) -> JobSpec:
    """A copy of `spec` whose ranks rendezvous on `port`."""
    return spec.model_copy(update={"launch": spec.launch.model_copy(update={"master_port": port})})


# -- the workers' environment ---------------------------------------------------------------
def worker_env(spec: JobSpec, nproc: int) -> dict[str, str]:
    """Variables every local worker inherits: threads per rank, so `nproc` ranks do not
    fight over the cores (`train.threads`, else the cores shared out as each rank's
    `runtime.setup` would), the start-up clock (kept when a caller set it), and a script's
    run dir."""
    threads = spec.train.threads or threads_per_rank(nproc)
    env = {envvars.OMP_NUM_THREADS: str(threads),
           envvars.T0: os.environ.get(envvars.T0) or str(_process_start())}
    if spec.script:  # where `disttrain.fit()` in the script writes (train/fit.py)
        env[envvars.RUN_DIR] = str(spec.run_dir.resolve())
    return env


def _process_start() -> float:
    """When this process started (the clock of "time to first step"), else now."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()


# -- torch's LaunchConfig ------------------------------------------------------------------
def launch_config(launch: LaunchSpec, nproc: int, *, name: str, start_method: str,
                  logs_dir: Path | None = None, scratch_dir: Path | None = None) -> LaunchConfig:
    """The one builder of torch's `LaunchConfig` for `elastic_launch`.

    Args:
        launch: the job's launch settings (nodes, address and port, rendezvous, restarts,
            timeout).
        nproc: processes on this node.
        name: the job's name; the run id is `<name>-<8 hex>` unless `launch.rdzv_id` is set.
        start_method: "forkserver" (workers forked from the warm server) or "spawn".
        logs_dir: where torch tees each worker's output (user scripts), lines prefixed
            `[rank<N>]:`; None leaves the workers' output as it is.
        scratch_dir: without `logs_dir`, where torch's agent keeps its per-attempt folders
            (the workers' error files): a folder the caller removes afterwards
            (`launch.agent_scratch`). One of the two is needed: torch's default logs spec
            makes a torchelastic_* folder in /tmp as the config is made, and leaves it.

    Raises:
        ValueError: neither `logs_dir` nor `scratch_dir` (a caller's mistake).
        LaunchError: this torch has no launcher disttrain can drive.

    Returns:
        A static rendezvous at master_addr:master_port on one node (rank 0: no store to
        wait for), c10d at rdzv_endpoint (default master_addr:master_port) on several.
    """
    from torch.distributed.launcher.api import LaunchConfig

    from disttrain.distributed.torch_compat import require

    try:
        require("launcher")  # `logs_specs` below; a pod's plain torchrun needs none of this
    except TorchVersionError as exc:
        raise LaunchError(str(exc)) from None
    if logs_dir is None and scratch_dir is None:
        raise ValueError("launch_config needs logs_dir or scratch_dir (launch.agent_scratch)")
    if launch.nnodes == 1:
        rdzv_backend, endpoint = "static", f"{launch.master_addr}:{launch.master_port}"
        configs: dict[str, Any] = {"rank": 0, "timeout": int(launch.timeout_s)}
    else:
        rdzv_backend = "c10d"
        endpoint = launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}"
        configs = {"timeout": int(launch.timeout_s),  # join_timeout: c10d's own deadline
                   "join_timeout": launch.rdzv_timeout_s or DEFAULT_RDZV_TIMEOUT_S}
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    if logs_dir is not None:
        logs_specs = DefaultLogsSpecs(log_dir=str(logs_dir), redirects=Std.NONE, tee=Std.ALL)
    else:   # torch's default would mkdtemp a torchelastic_* folder in /tmp per launch, kept
        logs_specs = DefaultLogsSpecs(log_dir=str(scratch_dir), redirects=Std.NONE, tee=Std.NONE)
    return LaunchConfig(
        min_nodes=launch.nnodes, max_nodes=launch.nnodes, nproc_per_node=nproc,
        run_id=launch.rdzv_id or f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=configs,
        max_restarts=launch.max_restarts, monitor_interval=MONITOR_INTERVAL_S,
        start_method=start_method, logs_specs=logs_specs,
        log_line_prefix_template="[rank${rank}]:" if logs_dir is not None else None,
        **_shutdown_timeout(launch),
    )


def _shutdown_timeout(launch: LaunchSpec) -> dict[str, int]:
    """How long torch's agent waits, after forwarding SIGTERM / SIGINT to the workers,
    before SIGKILL: the spec's `stop_grace_s`, time to agree on a step and write one
    checkpoint (torch's default is 30 s; older torch has no such setting and keeps its 30 s).
    See docs/resilience.md, "Graceful stop"."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {"shutdown_timeout": int(launch.stop_grace_s)} if "shutdown_timeout" in names else {}


# -- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    """A job ready to start here: the spec with the master port to use, the processes on
    this node, and the notes for the user (a port that moved)."""

    spec: JobSpec
    nproc: int
    notes: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What every worker inherits (`worker_env`)."""
        return worker_env(self.spec, self.nproc)

    def config(self, start_method: str, logs_dir: Path | None = None,
               scratch_dir: Path | None = None) -> LaunchConfig:
        """torch's LaunchConfig for this plan (`launch_config`)."""
        return launch_config(self.spec.launch, self.nproc, name=self.spec.name,
                             start_method=start_method, logs_dir=logs_dir, scratch_dir=scratch_dir)

    def moved_to(self, port: int, note: str) -> LaunchPlan:
        """The same plan on another port, with `note` saying why."""
        return replace(self, spec=with_port(self.spec, port), notes=[*self.notes, note])


def make_plan(spec: JobSpec, *, pick_port: bool = True) -> LaunchPlan:
    """Resolve the processes per node and, with `pick_port`, the master port (`choose_port`).

    `pick_port=False` keeps the port as given: under `--launcher env` every invocation of
    the job must use the same one.

    Raises:
        LaunchError: an explicitly requested port is taken.
    """
    nproc = resolve_nproc(spec)
    if not pick_port:
        return LaunchPlan(spec, nproc)
    port, note = choose_port(spec)
    return LaunchPlan(with_port(spec, port), nproc, [note] if note else [])


def start_error(plan: LaunchPlan, exc: Exception) -> LaunchError:
    """Why a launcher could not start the ranks of `plan`: the port (PortTaken, picked again when
    nobody asked for it) or the rendezvous, naming the flags to check."""
    launch, text = plan.spec.launch, str(exc).lower()
    if launch.nnodes == 1 and ("address already in use" in text or "eaddrinuse" in text):
        return PortTaken(f"master port {launch.master_port} is already in use (Address "
                         f"already in use); pass another --master-port (0 picks a free one)")
    endpoint = launch.rdzv_endpoint if launch.nnodes > 1 and launch.rdzv_endpoint \
        else f"{launch.master_addr}:{launch.master_port}"
    return LaunchError(
        f"cannot rendezvous at {endpoint} ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:200]}); check --master-addr/--master-port (or "
        f"--rdzv-endpoint), that node 0 is up, and --timeout-s")
