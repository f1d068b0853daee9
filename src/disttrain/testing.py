"""Run a function on N real ranks: for tests of distributed code (yours and ours).

    from disttrain.testing import run_ranks
    results = run_ranks(2, my_fn, arg1, timeout_s=60)     # {0: value0, 1: value1}

Built on torch's elastic launcher (no home-made process management), with the same
`LaunchConfig` as `disttrain run` (`disttrain.launch.plan.launch_config`): a static
rendezvous on a free loopback port, gloo, and workers forked from a warm fork server
(torch pre-imported) so each test starts in a fraction of a second. The function runs
with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set; call `disttrain.distributed.runtime.setup()` in it.
`timeout_s` bounds every collective (via `envvars.TEST_TIMEOUT_S`, read by `setup_for_test`)
and the rendezvous, so a hang becomes a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from disttrain import envvars
from disttrain.launch.plan import launch_config
from disttrain.launch.ports import free_port
from disttrain.spec.job import LaunchSpec

# What the test ranks' fork server imports once: torch and the rank side, not the
# built-in job's training modules that `disttrain run`'s warm server loads.
PRELOAD = ["torch", "torch.distributed", "disttrain.distributed.runtime"]


def _entry(fn: Callable[..., Any], env: dict[str, str], args: tuple[Any, ...]) -> Any:
    os.environ.update(env)
    return fn(*args)


def run_ranks(nproc: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
              env: dict[str, str] | None = None, max_restarts: int = 0) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local ranks and return {rank: return value}.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.
    """
    import multiprocessing

    from torch.distributed.launcher.api import elastic_launch

    multiprocessing.set_forkserver_preload(PRELOAD)
    launch = LaunchSpec(master_port=free_port(), timeout_s=timeout_s, max_restarts=max_restarts)
    config = launch_config(launch, nproc, name="test", start_method="forkserver")
    child_env = {envvars.OMP_NUM_THREADS: "1", envvars.TEST_TIMEOUT_S: str(timeout_s), **(env or {})}
    saved = dict(os.environ)  # the elastic agent sets TORCHELASTIC_* in this process
    try:
        return elastic_launch(config, _entry)(fn, child_env, args)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def setup_for_test(backend: str = "gloo"):
    """`runtime.setup()` with the collective timeout of the enclosing `run_ranks`."""
    from disttrain.distributed import runtime

    timeout = envvars.ranks_timeout_s()
    return runtime.setup(backend, timeout_s=timeout, threads=1)
