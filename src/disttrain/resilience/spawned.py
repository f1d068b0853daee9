"""A script that starts its own workers (`mp.spawn`), run the way `python script.py` runs
it, with those workers watched (docs/resilience.md, "Scripts that spawn their own workers").

    own = OwnWorkers(timeout_s=300, worker=script_heartbeat.watched_worker, run_dir=run_dir)
    own.clean_environment()            # torchrun's rank variables gone, as under plain python
    own.install(torch.multiprocessing) # mp.spawn / start_processes start watched workers

Why: `disttrain run main.py --nproc-per-node 1` starts the script once under torchrun, and
the script's own `mp.spawn` children inherit torchrun's environment:
`TORCHELASTIC_USE_AGENT_STORE=True` makes every child's `init_process_group("env://")` a
client of a store that nobody serves (torch.distributed.rendezvous `_env_rendezvous_handler`
with the agent's store), and they wait forever with empty logs (issue 25 item 1). The
script expects plain python's environment, so the entry removes what torchrun's agent set
for its worker (local_elastic_agent.py `_start_workers`) before the script runs.

The workers are still watched: the parent (this process, which only waits in
`mp.spawn`'s join) serves a private c10d store (`TCPStore` on a free loopback port) and
runs a `watchdog.Watchdog` over the workers' heartbeats, which each worker publishes from
the same hooks as a torchrun rank (`worker`: the spawn target is wrapped, picklable by
reference). A stalled worker is named on stderr and SIGKILLed; mp.spawn then fails the
script, and torchrun the job. Workers started with `multiprocessing.Process` get the clean
environment but no heartbeat (their target is not wrapped).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from disttrain import envvars

# What torch's agent sets for its worker besides the launch contract (local_elastic_agent.py)
_AGENT_VARS = ("GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
               "TORCHELASTIC_MAX_RESTARTS")
TORCHRUN_VARS = (*envvars.LAUNCH_CONTRACT, envvars.GROUP_RANK, envvars.RESTART_COUNT,
                 envvars.RUN_ID, envvars.USE_AGENT_STORE, envvars.ERROR_FILE, *_AGENT_VARS)


class OwnWorkers:
    """The parent side: a clean environment, and a watched `start_processes`.

    Args:
        timeout_s: a worker without progress this long is stalled.
        worker: the picklable wrapper each worker runs, `worker(index, fn, watch, *args)`
            (`script_heartbeat.watched_worker`).
        run_dir: where the workers write their live files (None: none).
    """

    def __init__(self, timeout_s: float, worker: Callable[..., Any],
                 run_dir: str | None = None) -> None:
        self.timeout_s, self.worker, self.run_dir = timeout_s, worker, run_dir
        self.removed: dict[str, str] = {}
        self._store: Any = None
        self._watchdogs: list[Any] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def clean_environment(self) -> dict[str, str]:
        """Remove torchrun's variables from this process's environment (and so from its
        children's); returns what was removed."""
        for name in TORCHRUN_VARS:
            if name in os.environ:
                self.removed[name] = os.environ.pop(name)
        return self.removed

    def install(self, tmp: ModuleType) -> None:
        """Wrap `torch.multiprocessing`'s start_processes (what mp.spawn calls)."""
        module = sys.modules.get("torch.multiprocessing.spawn")
        original = getattr(module, "start_processes", None)
        if module is None or original is None:
            return

        def start_processes(fn: Callable[..., Any], args: tuple[Any, ...] = (),
                            nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
            watch = self._watch(int(nprocs))
            join = rest[0] if rest else kwargs.get("join", True)
            try:
                return original(self.worker, (fn, watch, *args), nprocs, *rest, **kwargs)
            finally:
                if join:
                    self.stop()

        for owner in (module, tmp):
            if getattr(owner, "start_processes", None) is original:
                self._saved.append((owner, "start_processes", original))
                owner.start_processes = start_processes

    def _watch(self, nprocs: int) -> dict[str, Any]:
        """Serve the workers' store, watch `nprocs` of them; what each worker needs to know."""
        import torch.distributed as dist

        from disttrain.resilience.watchdog import Stall, Watchdog, stall_line

        if self._store is None:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

        def report(stall: Stall) -> None:
            print(f"{stall_line(stall)} (a worker the script started with mp.spawn)",
                  file=sys.stderr, flush=True)

        wd = Watchdog("127.0.0.1", self._store.port, world_size=nprocs,
                      timeout_s=self.timeout_s, on_stall=report)
        self._watchdogs.append(wd.start())
        return {"store": ("127.0.0.1", self._store.port), "timeout_s": self.timeout_s,
                "run_dir": self.run_dir}

    def stop(self) -> None:
        for wd in self._watchdogs:
            wd.stop()
        self._watchdogs.clear()

    def remove(self) -> None:
        """Stop watching, put start_processes back (the store dies with the process)."""
        self.stop()
        for owner, name, original in reversed(self._saved):
            with contextlib.suppress(Exception):
                setattr(owner, name, original)
        self._saved.clear()
