"""Which process is which: every rank's process title says `disttrain rank R/W job NAME`.

    set_rank_title(rank=1, world_size=4, job="mnist")   # once, when the rank is known
    set_server_title(launcher_pid)                      # the warm fork server, forked from
                                                        # `disttrain run`

Why: local workers are forks of disttrain's warm fork server (`launch.forkserver`), so
without this every rank's command line is the server's (`python -c from
multiprocessing.forkserver import main ...`) and `ps`, `top`, `py-spy` or the kernel
OOM killer's log cannot tell rank 0 from rank 1 (docs/resilience.md, "Which process is
which"). `setproctitle` (the package every Python daemon uses for this) rewrites the
command line that /proc/PID/cmdline and `ps -o args` show; the kernel's short name
(/proc/PID/comm, 15 bytes, what the OOM killer and `top`'s default view print) gets
`dt rank R/W`. Called by `distributed.runtime.setup` for every launched rank (scripts,
verify and bench ranks: the job is torchrun's run id there) and again by
`train.build.build_trainer` with the spec's name. Setting a title costs a few
microseconds and happens once per process (re)start, never per step.

The warm fork server itself, when `disttrain run` forks it from itself (`launch.forkserver`,
share_torch), is titled `disttrain forkserver of PID` (its launcher's): otherwise `ps` shows it with the
launcher's own command line, two identical `disttrain run ...` lines per job. A title fits
in the launcher's command line's bytes (SPT_NOENV), hence a short one.
"""

from __future__ import annotations

import os

from disttrain import envvars

COMM_LIMIT = 15  # bytes of /proc/PID/comm (TASK_COMM_LEN - 1)


def rank_title(rank: int, world_size: int, job: str) -> str:
    """The full title: `disttrain rank 1/4 job mnist`."""
    return f"disttrain rank {rank}/{world_size} job {job}"


def short_title(rank: int, world_size: int) -> str:
    """The kernel's name of the process (at most 15 bytes): `dt rank 1/4`."""
    return f"dt rank {rank}/{world_size}"[:COMM_LIMIT]


def default_job() -> str:
    """The job's name where no spec is at hand: torchrun's run id, else `?`."""
    return os.environ.get(envvars.RUN_ID) or "?"


def set_rank_title(rank: int, world_size: int, job: str | None = None) -> bool:
    """Title this process as rank `rank` of `world_size` in `job`; False where the
    `setproctitle` package is missing (an image that has disttrain without its
    dependencies): the title is a convenience, never a reason to fail a rank."""
    return _set_title(rank_title(rank, world_size, job or default_job()),
                      short_title(rank, world_size))


def server_title(launcher_pid: int) -> str:
    """The warm fork server's title: `disttrain forkserver of 4242`."""
    return f"disttrain forkserver of {launcher_pid}"


def set_server_title(launcher_pid: int) -> bool:
    """Title this process as the warm fork server of launcher `launcher_pid` (its kernel
    name `dt forkserver`); False where `setproctitle` is missing."""
    return _set_title(server_title(launcher_pid), "dt forkserver")


def _set_title(title: str, comm: str) -> bool:
    try:
        import setproctitle
    except ImportError:
        return False
    # without SPT_NOENV the title may grow over the environment block, and
    # /proc/PID/environ (what `ps e` and debuggers read) is lost
    with envvars.set_while(envvars.SPT_NOENV, "1"):
        setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(comm[:COMM_LIMIT])  # main thread: the process's comm
    return True
