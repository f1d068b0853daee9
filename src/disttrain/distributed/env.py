"""This process's place in the job, from the launcher's environment or a script's flags.

    from disttrain.distributed.env import read_env
    env = read_env()                     # os.environ; read_env({}) = a single process
    env.rank, env.world_size, env.master_addr

This is the only module that reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (declared in `envvars.LAUNCH_CONTRACT`): one reader means one
set of rules for what is missing or malformed. torchrun sets all of them; `python
train.py` with none of them set is a single process (world size 1). A variable that is
set but malformed is an error naming it, never a silent default. Pure: no torch, nothing
written to the environment, so the launcher and the CLI can use it without paying for
`import torch`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from disttrain import envvars
from disttrain.errors import DistEnvError


@dataclass(frozen=True)
class DistEnv:
    """What the launcher told this process about its place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    by_agent: bool = False    # torch's elastic agent started it (`envvars.started_by_agent`)

    @property
    def launched(self) -> bool:
        """True when started by a launcher (torchrun, spawn helper, env), not plain python."""
        return self.world_size > 1 or self.rank > 0

    @property
    def worker(self) -> bool:
        """One rank of a launched job, a one-rank job's worker included: titled, and its own
        session, as torchrun's workers (`runtime.setup`; docs/performance.md, "One rank,
        too"). A user's own single process is not one."""
        return self.launched or self.by_agent


def _int_var(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    if default is None and env.get(name) in (None, ""):
        raise DistEnvError(f"{name} is not set; launch with torchrun (or `disttrain run`), "
                           f"or export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself "
                           f"(docs/environment.md)")
    return envvars.int_var(name, 0 if default is None else default, minimum, environ=env)


def read_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Parse the launcher's variables; none set at all means a single process.

    Args:
        env: the environment to read (default os.environ).

    Returns:
        This process's DistEnv.

    Raises:
        DistEnvError: a variable is malformed, or some are set and a required one is not.
    """
    env = os.environ if env is None else env
    if not any(env.get(v) for v in (envvars.RANK, envvars.WORLD_SIZE)):
        return DistEnv()
    world = _int_var(env, envvars.WORLD_SIZE, None, 1)
    rank = _int_var(env, envvars.RANK, None, 0)
    if rank >= world:
        raise DistEnvError(f"RANK={rank} must be < WORLD_SIZE={world}")
    local_rank = _int_var(env, envvars.LOCAL_RANK, 0 if world == 1 else rank, 0)
    local_world = _int_var(env, envvars.LOCAL_WORLD_SIZE, world, 1)
    if local_rank >= local_world:
        raise DistEnvError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world}")
    addr = env.get(envvars.MASTER_ADDR) or ""
    if world > 1 and not addr:
        raise DistEnvError("MASTER_ADDR is not set; export the rank-0 host, e.g. "
                           "MASTER_ADDR=localhost")
    port = _int_var(env, envvars.MASTER_PORT, None if world > 1 else 29500, 1)
    if port > 65535:
        raise DistEnvError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return DistEnv(rank, world, local_rank, local_world, addr or "127.0.0.1", port,
                   envvars.started_by_agent(env))


# -- `python train.py --world-size N --rank R`: a script placed in the job by its flags --------
def add_dist_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let a user script take its place in the job from flags instead of torchrun's env.

    Adds --world-size, --rank, --master-addr, --master-port, --backend, and (hidden)
    --local-rank/--local_rank, which the deprecated `python -m torch.distributed.launch`
    passes; under torchrun none of them is needed. Use with `runtime.setup_from_args`.

    Example:
        >>> parser = add_dist_args(argparse.ArgumentParser())
        >>> args = parser.parse_args()              # python train.py --world-size 4 --rank 0
        >>> with runtime.setup_from_args(args) as rt:
        ...     rt.print0(rt.rank, rt.world_size)
    """
    # NOTE: the title is --help output, unchanged; it names the module of setup_from_args.
    g = parser.add_argument_group("distributed (disttrain.distributed.runtime)")
    g.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="processes in the job (default: WORLD_SIZE from the launcher, else 1)")
    g.add_argument("--rank", type=int, default=None, metavar="R",
                   help="this process's rank, 0..N-1 (default: RANK from the launcher)")
    g.add_argument("--master-addr", default=None, help="rank 0's host (default MASTER_ADDR or 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rank 0's rendezvous port (default MASTER_PORT or 29500)")
    g.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="auto = nccl when every local rank has a GPU, else gloo")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return parser


def env_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None
                  ) -> dict[str, str] | None:
    """The launcher env contract (RANK, WORLD_SIZE, ...) with the flags applied on top.

    Returns None when no flag was given, so `setup` reads the real environment (torchrun).
    One host is assumed for LOCAL_RANK / LOCAL_WORLD_SIZE unless the env says otherwise.
    The result is a new mapping: the process environment is never written.

    Raises:
        DistEnvError: only one of --world-size / --rank, or a rank outside the world.
    """
    base = dict(os.environ if env is None else env)
    world, rank, local = args.world_size, args.rank, args.local_rank
    if world is None and rank is None:
        if local is None:
            return None
        base[envvars.LOCAL_RANK] = str(local)  # torch.distributed.launch: the rest is in the env
        return base
    world = world if world is not None else _int_var(base, envvars.WORLD_SIZE, None, 1)
    if rank is None:
        if envvars.RANK not in base:
            raise DistEnvError(
                f"--world-size {world} needs --rank R (0..{world - 1}) for this process; to "
                f"start all {world} ranks here use `torchrun --nproc_per_node {world} "
                f"train.py` or `disttrain run train.py --nproc-per-node {world}`")
        rank = _int_var(base, envvars.RANK, None, 0)
    if world < 1 or not 0 <= rank < world:
        raise DistEnvError(f"--rank {rank} must be in 0..{world - 1} (--world-size {world})")
    base.update({
        envvars.WORLD_SIZE: str(world), envvars.RANK: str(rank),
        envvars.LOCAL_RANK: str(local if local is not None else base.get(envvars.LOCAL_RANK, rank)),
        envvars.LOCAL_WORLD_SIZE: base.get(envvars.LOCAL_WORLD_SIZE, str(world)),
        envvars.MASTER_ADDR: args.master_addr or base.get(envvars.MASTER_ADDR) or "127.0.0.1",
        envvars.MASTER_PORT: str(args.master_port or base.get(envvars.MASTER_PORT) or 29500),
    })
    return base
