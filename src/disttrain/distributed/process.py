"""Per-process settings every rank makes once: allocator, threads, seeds, its own session.

    from disttrain.distributed.process import rank_seed, seed_everything, threads_per_rank
    seed_everything(spec.seed)                # the same on every rank: models start identical
    gen = torch.Generator().manual_seed(rank_seed(spec.seed, rank))   # differs per rank
    torch.set_num_threads(threads_per_rank(local_world_size))

None of these touch the process group, so they are kept apart from `runtime.setup`,
which calls them. `import torch` is deferred to `seed_everything`: the launcher computes
threads per rank before any worker (or torch) exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import sys
from pathlib import Path

from disttrain import envvars


def tune_allocator() -> bool:
    """Pin glibc malloc's mmap/trim thresholds so freed gradient buffers are reused.

    By default glibc adapts these thresholds per process, and a training step's ~MB-sized
    buffers are often handed back to the OS and page-faulted in again every step
    (x1.5-1.8 step time on small models; docs/performance.md). mallopt at run time has
    the same effect as GLIBC_TUNABLES, also in forked workers.

    Returns:
        True when both thresholds were set (False off Linux, with `envvars.NO_MALLOPT`
        set, or when libc has no mallopt).
    """
    if envvars.flag(envvars.NO_MALLOPT) or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        ok &= libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)
        return bool(ok)
    except (OSError, AttributeError):
        return False


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def own_session(autogroup: Path = AUTOGROUP) -> bool:
    """Make this rank the leader of a new session, as torchrun's agent makes every worker it
    starts (`start_new_session=True`), when the kernel schedules by session (autogroup).

    With autogroup on (Linux's default on desktops and many VMs), CPU time is shared between
    sessions first and between threads only inside one. A plain `torchrun` job's workers
    are each a session of their own; disttrain's, forked from the warm fork server, stayed in
    the launcher's, where they shared one session's CPU with whatever else runs there (a
    build, a benchmark's busy processes). Measured on the shared 2-vCPU VM (issue 21,
    docs/performance.md "Under CPU contention"): same CPU per step as the plain loop, but
    3-7x its time waiting in the run queue, and 0.3-0.6x its samples/s. A new session puts
    the rank on the same footing as a torchrun worker; nothing else changes: the agent
    still signals and reaps it by pid.

    Returns:
        True when a new session was made; False with autogroup off or unknown, off Linux,
        or when the process already leads a group or session (e.g. torchrun's own workers).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        if autogroup.read_text().strip() != "1":
            return False
        os.setsid()
    except OSError:
        return False
    return True


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_rank(local_procs: int) -> int:
    """torch intra-op threads for each of `local_procs` ranks on this machine: the usable
    cores shared out evenly (at least 1), so the ranks do not oversubscribe the CPUs."""
    return max(1, usable_cores() // max(1, local_procs))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and all GPUs) with `seed`."""
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible seed per rank for data workers and augmentation: with one
    seed on every rank, each rank would draw the same random crops and flips."""
    return (seed * 1_000_003 + rank * 7919 + 1) % 2**31
