"""Run a function on N real ranks: for tests of distributed code (yours and ours).

    from disttrain.testing import run_ranks
    results = run_ranks(2, my_fn, arg1, timeout_s=60)     # {0: value0, 1: value1}

Built on torch's elastic launcher (no home-made process management), with the same
`LaunchConfig` as `disttrain run` (`disttrain.launch.plan.launch_config`): a static
rendezvous on a free loopback port, gloo, and workers forked from a warm fork server
(torch pre-imported) so each test starts in a fraction of a second. The function runs
with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set; call `disttrain.distributed.runtime.setup()` in it.
`timeout_s` bounds every collective (via `envvars.TEST_TIMEOUT_S`, read by `setup_for_test`)
and the rendezvous; `wall_s` (default: twice `timeout_s`, room for a run of many
collectives on a busy machine) bounds the run once the ranks have started (the start is
bounded by `timeout_s`), since a rank stuck outside a collective (a deadlock, a sleep, a
loop) is bounded by nothing else: the ranks still running then are named with where they
are (each rank's stack, dumped by faulthandler on SIGUSR1), killed, and `RanksTimedOut` is
raised, so a hang becomes a failure that says which rank and where.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.launch.agent_scratch import agent_scratch
from disttrain.launch.plan import launch_config
from disttrain.launch.ports import free_port
from disttrain.spec.job import LaunchSpec

# What the test ranks' fork server imports once, as `disttrain run`'s warm server does:
# torch._dynamo (the first optimizer call imports it), DDP, the Trainer's modules, and
# matplotlib's figure and Agg canvas (every Trainer run's rank 0 draws loss.png at its end,
# `rundir.plot_loss`: ~0.6 s of CPU a run otherwise). It cut tests/train/test_trainer_dist.py
# + test_task_trainer.py from 86-92 to 52-60 s. Twice a clean-clone suite then hung in
# test_trainer_dist.py, ranks done and never exiting: with torch._dynamo imported before
# the group, destroy_process_group let the group go, and a DDP Reducer freed later ran
# gloo's destructor under the GIL while gloo's worker waited for the GIL (a deadlock;
# reproduced with py-spy in 1 of ~8 rounds on 2 busy cores). `Runtime.shutdown` now keeps
# the groups it destroys (`runtime._retire_groups`): 300 rounds of the same repro passed.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "disttrain.distributed.runtime", "disttrain.train.build",
           "matplotlib.figure", "matplotlib.backends.backend_agg"]


class RanksTimedOut(TimeoutError):
    """Ranks still ran when `run_ranks`' wall-clock bound passed; names them and where."""


def _entry(fn: Callable[..., Any], env: dict[str, str], args: tuple[Any, ...],
           marks: str) -> Any:
    """One rank: its pid and, on SIGUSR1, its stack in `marks` (for `_Overtime`)."""
    os.environ.update(env)
    rank = os.environ.get(envvars.RANK, "0")
    folder = Path(marks)
    stack = open(folder / f"stack-{rank}.txt", "w")   # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    (folder / f"pid-{rank}").write_text(str(os.getpid()))
    try:
        return fn(*args)
    finally:
        (folder / f"done-{rank}").touch()


class _Overtime:
    """`wall_s` after every rank has started (or `start_s` after the launch, when some never
    do), the ranks that have not returned: their stacks, then SIGKILL (the agent then
    reports them failed, and `run_ranks` raises `RanksTimedOut` instead). The clock starts
    with the ranks, not the launch: forking them from a fork server that is still
    importing torch takes seconds to a minute on a busy machine, and that is not the test's."""

    def __init__(self, marks: Path, nproc: int, wall_s: float, start_s: float) -> None:
        self.marks, self.nproc, self.wall_s, self.start_s = marks, nproc, wall_s, start_s
        self.stuck: dict[int, str] = {}   # rank -> where it was
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="run-ranks-overtime", daemon=True)

    def __enter__(self) -> _Overtime:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._over.set()
        self._thread.join(timeout=10)

    def _running(self) -> dict[int, int]:
        """rank -> pid of the ranks that started and have not returned."""
        out = {}
        for rank in range(self.nproc):
            pid_file = self.marks / f"pid-{rank}"
            if pid_file.exists() and not (self.marks / f"done-{rank}").exists():
                with contextlib.suppress(OSError, ValueError):
                    out[rank] = int(pid_file.read_text())
        return out

    def _started(self) -> int:
        return sum((self.marks / f"pid-{rank}").exists() for rank in range(self.nproc))

    def _watch(self) -> None:
        give_up = time.monotonic() + self.start_s
        while self._started() < self.nproc and time.monotonic() < give_up:
            if self._over.wait(0.2):
                return
        if self._over.wait(self.wall_s):
            return
        running = self._running()
        absent = [r for r in range(self.nproc) if not (self.marks / f"pid-{r}").exists()]
        if not running and not absent:
            return   # every rank returned: the agent is only collecting the values
        for pid in running.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)   # faulthandler writes at once; a process that holds the GIL still can
        for rank in running:
            self.stuck[rank] = _where(self.marks / f"stack-{rank}.txt")
        self.stuck |= {rank: "never started" for rank in absent}
        # Every rank goes, the ones that returned too: they would wait for the agent, which
        # gives a worker 30 s to answer its SIGTERM; a restarting agent (max_restarts)
        # starts them again, so they are kept down until it gives up.
        killed: set[int] = set()   # each pid once: a dead one's number may be reused
        while True:
            for pid in set(self._pids()) - killed:
                killed.add(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if self._over.wait(0.5):
                return

    def _pids(self) -> list[int]:
        out = []
        for rank in range(self.nproc):
            with contextlib.suppress(OSError, ValueError):
                out.append(int((self.marks / f"pid-{rank}").read_text()))
        return out

    def error(self) -> RanksTimedOut:
        ranks = ", ".join(str(r) for r in sorted(self.stuck))
        where = "\n".join(f"rank {r}: {w}" for r, w in sorted(self.stuck.items()))
        return RanksTimedOut(f"rank(s) {ranks} still running {self.wall_s:g} s after the ranks "
                             f"started (run_ranks' wall_s); stopped. Where each was:\n{where}")


def _where(stack_file: Path, lines: int = 12) -> str:
    """The first frames of a rank's faulthandler dump (most recent call first)."""
    try:
        text = stack_file.read_text().strip()
    except OSError:
        text = ""
    if not text:
        return "no stack (the process did not answer SIGUSR1)"
    kept: list[str] = []
    for line in text.splitlines():
        if "in _entry" in line:   # the frames below the test's function are the launcher's
            break
        kept.append(line)
    return "\n  ".join(kept[:lines])


def run_ranks(nproc: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
              env: dict[str, str] | None = None, max_restarts: int = 0,
              wall_s: float | None = None) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local ranks and return {rank: return value}.

    Args:
        timeout_s: bounds each collective and the rendezvous.
        wall_s: bounds the run from when every rank has started (default: 2 * `timeout_s`;
            the start itself is bounded by `timeout_s`).

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.
        RanksTimedOut: ranks still ran after `wall_s`; names them and where they were.
    """
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    multiprocessing.set_forkserver_preload(PRELOAD)
    launch = LaunchSpec(master_port=free_port(), timeout_s=timeout_s, max_restarts=max_restarts)
    child_env = {envvars.OMP_NUM_THREADS: "1", envvars.TEST_TIMEOUT_S: str(timeout_s), **(env or {})}
    saved = dict(os.environ)  # the elastic agent sets TORCHELASTIC_* in this process
    marks = Path(tempfile.mkdtemp(prefix="disttrain-ranks-"))
    try:
        bound = 2 * timeout_s if wall_s is None else wall_s
        with agent_scratch() as scratch, \
                _Overtime(marks, nproc, bound, start_s=timeout_s) as overtime:
            config = launch_config(launch, nproc, name="test", start_method="forkserver",
                                   scratch_dir=scratch)
            try:
                return elastic_launch(config, _entry)(fn, child_env, args, str(marks))
            except ChildFailedError as exc:
                if overtime.stuck:
                    raise overtime.error() from exc
                raise
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(marks, ignore_errors=True)


def setup_for_test(backend: str = "gloo"):
    """`runtime.setup()` with the collective timeout of the enclosing `run_ranks`."""
    from disttrain.distributed import runtime

    timeout = envvars.ranks_timeout_s()
    return runtime.setup(backend, timeout_s=timeout, threads=1)
