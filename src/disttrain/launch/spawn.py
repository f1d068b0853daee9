"""`--launcher spawn`: the ranks as torch.multiprocessing workers (what mp.spawn is) of this
process, which hosts the job's store and forwards stop signals, as torchrun's agent would.

    result = SpawnLauncher().launch(make_plan(spec))

Used through `disttrain.launch.launchers.launch` (`--launcher spawn`); the workers are
forked from the warm fork server where there is one (docs/quickstart.md, "Launchers").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from disttrain import envvars
from disttrain.errors import LaunchError
from disttrain.launch.forkserver import worker_start_method
from disttrain.launch.plan import LaunchPlan, start_error
from disttrain.launch.result import LaunchResult, RankFailure
from disttrain.launch.signals import forwarding_signals


def _spawn_entry(local_rank: int, spec_data: dict[str, Any], nproc: int) -> None:
    """mp.spawn target: set the environment contract for this rank, then run it."""
    launch = spec_data["launch"]
    contract = {
        envvars.RANK: str(launch["node_rank"] * nproc + local_rank),
        envvars.WORLD_SIZE: str(launch["nnodes"] * nproc), envvars.LOCAL_RANK: str(local_rank),
        envvars.LOCAL_WORLD_SIZE: str(nproc), envvars.MASTER_ADDR: launch["master_addr"],
        envvars.MASTER_PORT: str(launch["master_port"]),
        envvars.USE_AGENT_STORE: "True",   # the launcher's store (`_launcher_store`)
    }
    for name, value in contract.items():
        envvars.set_env(name, value)
    from disttrain.worker import run_worker

    run_worker(spec_data)


class SpawnLauncher:
    """`--launcher spawn`: torch.multiprocessing's start_processes, which mp.spawn is, with
    the workers forked from the warm fork server where there is one (the start method is
    the only difference: no torch import per worker)."""

    def launch(self, plan: LaunchPlan) -> LaunchResult:
        spec, nproc = plan.spec, plan.nproc
        if spec.script:
            raise LaunchError("--launcher spawn runs the built-in job; run a script with torchrun "
                              "(the default) or call mp.spawn inside it")
        import torch.multiprocessing as mp

        method = worker_start_method()
        first = spec.launch.node_rank * nproc
        with _launcher_store(plan):
            ctx = mp.start_processes(_spawn_entry, args=(spec.model_dump(), nproc), nprocs=nproc,
                                     join=False, start_method=method)
            with forwarding_signals([p.pid for p in ctx.processes]) as got, \
                    _removing(ctx.error_files):
                try:
                    _join_within_grace(ctx, got, spec.launch.stop_grace_s)
                except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                    if got:
                        return LaunchResult.stopped(got[0])
                    code = getattr(exc, "exit_code", 1)
                    failure = RankFailure(str(exc), exitcode=code, pid=exc.error_pid)
                    return LaunchResult.failed({first + exc.error_index: failure},
                                               log_text=str(exc))
        return LaunchResult.stopped(got[0]) if got else LaunchResult()


@contextlib.contextmanager
def _launcher_store(plan: LaunchPlan) -> Iterator[None]:
    """The job's TCPStore, hosted by this process while its `--launcher spawn` workers run
    (on node 0; the workers are all its clients, `TORCHELASTIC_USE_AGENT_STORE=True`), as
    torchrun's agent hosts its own.

    Why: bound here before any worker starts, the port is the job's or a PortTaken that
    is picked again, never shared. With rank 0 binding it a second or two after the port
    was checked, another job started meanwhile on the same port had its store joined by
    this job's other ranks and watchdog (seen: two jobs started together on 29500, one
    job's rank 1 talking to the other's store). And the store outlives every rank, so a
    rank that fails first no longer takes it from its peers (`Runtime._fail_together`).
    """
    launch = plan.spec.launch
    if launch.node_rank != 0:
        yield
        return
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, is_master=True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=launch.timeout_s))
    except RuntimeError as exc:   # torch's DistError is one
        raise start_error(plan, exc) from None
    try:
        yield
    finally:
        del store   # the server closes with its last reference


PEER_EXIT_GRACE_S = 10.0
"""After one `--launcher spawn` worker failed, how long the others have to end on their own
before torch's join sends them SIGTERM (then as long again before SIGKILL). A peer that
raised the same error a moment later writes its own typed failure record, and one inside a
collective sees the closed connection; without it, join's immediate SIGTERM left such a
rank without a record (a clean-clone CI run under load: only rank 1's of two)."""


def _join_within_grace(ctx: Any, got: list[int], grace_s: float) -> None:
    """Wait for mp.start_processes' workers; once a stop signal was forwarded to them,
    at most `grace_s` more before SIGKILL, as torch's agent does for torchrun."""
    deadline: float | None = None
    while not ctx.join(timeout=0.1, grace_period=PEER_EXIT_GRACE_S):
        if got and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()


@contextlib.contextmanager
def _removing(error_files: list[str]) -> Iterator[None]:
    """Remove the /tmp/pytorch-errorfile-*.pickle of the workers that failed once their
    join is over: torch's join reads the first and leaves them all behind."""
    try:
        yield
    finally:
        for name in error_files:
            with contextlib.suppress(OSError):
                os.unlink(name)
