"""How a rank waits for its step's last gloo all-reduce: polling, or blocking like plain DDP.

    choice = choose_wait(local_ranks=2, threads=1)      # once, when the comm hook is set up
    choice.poll, choice.describe()    # True, "poll: 2 CPUs for 2 ranks x 1 thread, probe 0.97"

Polling (`comm_hooks.yield_until_done`, sched_yield in a loop) keeps the waiting thread on its
core, so gloo's thread hand-offs do not pay a vCPU wake-up each: 5-9 % shorter steps on an idle
2-vCPU VM (docs/performance.md). It needs a core that nothing else wants. When other processes
are runnable on the same cores, each sched_yield hands them the CPU and the spinning thread
still spends its share of it: the Trainer measured 0.80x a plain DDP loop with two busy
processes on the 2 cores (issue 21), where blocking (what DDP does) lets the scheduler wake the
rank as soon as its data arrives. So the rank polls only when all of these hold, decided once:

- `envvars.COMM_WAIT` is unset or `auto` (`poll` / `block` force a side, for A/B runs);
- the CPUs it may use (its affinity mask, and its cgroup's CPU quota: cgroup v2 `cpu.max`,
  v1 `cpu.cfs_quota_us`; a pod's CPU limit is one) hold the local ranks x their torch threads;
- a short probe finds a core free now: spinning for `PROBE_S`, the thread gets at least
  `FREE_SHARE` of the wall time (about 1.0 when a core is free, 0.5 with one other runnable
  task per core). The load average would say the same a minute late.

That first choice can be wrong, and the load can change while the job runs: a probe at set-up
once read 1.00 beside two busy processes (the peer rank was still idle then), and that round
of `bench overhead --contend 2` ran at 0.74x the plain loop. So where polling is allowed at
all, `WaitTuner` then measures both ways on the job's own steps: from step `SETTLE_STEPS` it
polls and blocks in turn, `TRIAL_STEPS` steps each (in turn, because a block of polled steps
then a block of blocked ones once measured polling faster beside busy processes: the steps
drift), and polls until the next trial only if
its median step is `POLL_MARGIN` of blocking's or shorter. The margin is there because the
two mistakes do not cost the same: a wrong poll beside busy processes makes steps twice as
long, a wrong block on a free core 5-12 % longer; 8 steps a side once chose polling there.
The gap to the next trial doubles each time, from `FIRST_GAP_STEPS` to `MAX_GAP_STEPS`, so
the slower way's steps in a trial cost at most `TRIAL_STEPS / gap` of the steps at that way's
price (16 polled steps in every 256 cost ~5 % beside busy processes; 12 in 512 at most 2.3 %,
then less). Between trials a rank that polls holds polling to the trial's blocked steps:
every `GUARD_STEPS` polled steps whose median is longer turn it to blocking until the next
trial (a trial's alternating steps can favour polling while polling for the rest of the run
does not). The schedule depends on the step count only, so the ranks try each way in the
same steps. The process's CPU share while it polls was measured and does not tell the two
cases apart: about 1.0 both on a quiet machine and beside two busy processes
(docs/performance.md).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from disttrain import envvars
from disttrain.distributed.process import usable_cores

PROBE_S = 0.05
FREE_SHARE = 0.85
# A blocking rank's trial that finds polling faster turns it to polling only when a probe
# then reads this much: beside two busy processes one such probe read 0.89 (and that round,
# polling, ran at 0.86x the plain loop); on a quiet machine probes read 0.99-1.00.
SWITCH_SHARE = 0.95
SETTLE_STEPS = 5         # steps before the first trial (the first ones hold the set-up)
TRIAL_STEPS = 12         # steps of each way per trial
POLL_MARGIN = 0.95       # poll only when its median step is this much shorter, or more
GUARD_STEPS = 32         # polled steps after a trial whose median is held against blocking's
FIRST_GAP_STEPS = 512    # from the first trial's start to the second's; doubles after each
MAX_GAP_STEPS = 8192     # at most this far apart
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class WaitChoice:
    """Poll or block, and what the choice was made from (summary.json's `comm_wait`)."""

    poll: bool
    reason: str
    tunable: bool = False   # the CPUs allow polling: `WaitTuner` may measure both ways

    def describe(self) -> str:
        return f"{'poll' if self.poll else 'block'}: {self.reason}"


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> list[Path]:
    """This process's cgroup folders holding CPU limits, innermost first, with their parents
    up to the mount (a limit on any ancestor applies too)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":                       # cgroup v2: "0::/path"
            mounts = [root, root / "unified"]
        elif "cpu" in controllers.split(","):      # cgroup v1: "N:cpu,cpuacct:/path"
            mounts = [root / controllers, root / "cpu"]
        else:
            continue
        for mount in mounts:
            if not mount.is_dir():
                continue
            inner = mount / path.lstrip("/")
            start = inner if inner.is_dir() else mount  # in a container the mount is its own root
            found += [start, *[p for p in start.parents if p.is_relative_to(mount)]]
            break
    return found


def _limit_of(folder: Path) -> float | None:
    """CPUs the quota of one cgroup folder allows (None: no quota there)."""
    try:
        quota, _, period = (folder / "cpu.max").read_text().partition(" ")
        if quota.strip() != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def cgroup_cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = CGROUP_ROOT) -> float | None:
    """The smallest CPU quota over this process's cgroup and its ancestors, in CPUs
    (e.g. 1.5 for a pod with `limits.cpu: 1500m`); None when no quota applies."""
    limits = [x for x in (_limit_of(d) for d in _cgroup_dirs(proc_cgroup, root)) if x is not None]
    return min(limits) if limits else None


def usable_cpus(limit: float | None = None) -> float:
    """CPUs this process may run on: its affinity mask, capped by its cgroup quota."""
    cores = float(usable_cores())
    limit = cgroup_cpu_limit() if limit is None else limit
    return min(cores, limit) if limit is not None else cores


def free_core_share(probe_s: float = PROBE_S) -> float:
    """Spin for `probe_s`; the share of that wall time the thread really ran (1.0: a core
    of its own; about 1 / (runnable tasks per core) under contention)."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < probe_s:
        pass
    return (time.thread_time() - cpu0) / (time.perf_counter() - wall0)


def choose_wait(local_ranks: int, threads: int, environ: dict[str, str] | None = None,
                cpus: float | None = None, share: float | None = None) -> WaitChoice:
    """Poll only with a spare core for every local rank's threads (see the module docstring).

    `cpus` and `share` stand in for the measurements (tests); the probe runs only when the
    CPU count allows polling at all.
    """
    forced = envvars.comm_wait(environ)
    if forced != "auto":
        return WaitChoice(forced == "poll", f"{envvars.COMM_WAIT}={forced}")
    cpus = usable_cpus() if cpus is None else cpus
    need = local_ranks * threads
    have = f"{cpus:g} CPUs for {local_ranks} rank{'s' * (local_ranks != 1)} x {threads} " \
           f"thread{'s' * (threads != 1)}"
    if math.floor(cpus + 1e-9) < need:
        return WaitChoice(False, f"{have}: no core to spare")
    share = free_core_share() if share is None else share
    if share < FREE_SHARE:
        return WaitChoice(False, f"{have}, but other processes want them (probe {share:.2f})",
                          tunable=True)
    return WaitChoice(True, f"{have}, probe {share:.2f}", tunable=True)


def local_ranks_here() -> int:
    """Ranks on this host, from the launcher's LOCAL_WORLD_SIZE (1 when not launched)."""
    from disttrain.distributed.env import read_env

    return read_env(os.environ).local_world_size


@dataclass
class WaitTuner:
    """Poll or block for each step's last all-reduce, from the job's own step times.

        tuner = WaitTuner(first=choice)    # choose_wait's choice, used until the first trial
        if tuner.poll_now(time.perf_counter()):   # at each step's last bucket
            yield_until_done(fut)

    A step's time is the wall time from one step's last bucket to the next; it is booked
    to the way the first of them waited. A trial is `2 * trial` steps polling and blocking
    in turn; then polling is kept until the next trial if its median step is at most
    `margin` times blocking's, else blocking (the costs are not even: polling beside busy
    processes took twice as long per step, blocking on a free core 5-12 % longer). A trial
    that would turn a blocking rank to polling must also find a core free now (`probe`
    reads `SWITCH_SHARE` or more): beside busy processes a trial's polled steps can look the faster
    while polling for the rest of the run is not (module docstring). And polling is held to
    its promise: every `guard` polled steps between trials, their median must stay at or
    below the last trial's blocking median, else the rank blocks until the next trial
    (beside busy processes a trial once measured 6.31 ms per step polling against 8.84
    blocking, with a probe of 0.99, and the round then polled at ~10 ms per step:
    docs/performance.md, "Polling held to its promise"). The first trial
    starts at step `settle`, the next `gap` steps after it, and each gap is twice the one
    before, up to `max_gap`.
    """

    first: WaitChoice
    settle: int = SETTLE_STEPS
    trial: int = TRIAL_STEPS
    gap: int = FIRST_GAP_STEPS
    max_gap: int = MAX_GAP_STEPS
    margin: float = POLL_MARGIN
    guard: int = GUARD_STEPS
    steps: int = 0
    polled: int = 0
    chosen: bool | None = None    # the last trial's winner (None: no trial ended yet)
    last_trial: tuple[float, float] | None = None   # (poll, block) median step, seconds
    last_probe: float | None = None   # the last trial's probe, when it needed one
    given_up: int = 0                 # times the guard turned polling back to blocking
    last_guard: float | None = None   # the median polled step that did it, seconds
    probe: Callable[[], float] = field(default=free_core_share, repr=False)
    _start: int = field(init=False, repr=False)     # this or the next trial's first step
    _trial_step: tuple[float, bool] | None = field(default=None, repr=False)  # (at, way)
    _kept_poll_at: float | None = field(default=None, repr=False)  # a guarded step's start
    _guarded: list[float] = field(default_factory=list, repr=False)
    _times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []},
                                            repr=False)

    def __post_init__(self) -> None:
        self._start = self.settle

    def poll_now(self, now: float) -> bool:
        """Called once per step at its last bucket: whether this step's wait polls."""
        if self._trial_step is not None:    # the step before was a trial's: book its time
            since, way = self._trial_step
            self._times[way].append(now - since)
        elif self._kept_poll_at is not None:    # a polled step between trials: guard it
            self._guarded.append(now - self._kept_poll_at)
            if len(self._guarded) == self.guard:
                self._hold_polling_to_its_promise()
        if self.steps - self._start == 2 * self.trial:  # a trial just ended
            if self._times[True] and self._times[False]:
                poll_s, block_s = (statistics.median(self._times[w]) for w in (True, False))
                poll = poll_s <= self.margin * block_s
                self.last_probe = None
                if poll and not self._kept():
                    self.last_probe = self.probe()
                    poll = self.last_probe >= SWITCH_SHARE
                self.chosen = poll
                self.last_trial = (poll_s, block_s)
            self._times = {True: [], False: []}
            self._guarded = []
            self._start += self.gap
            self.gap = min(2 * self.gap, self.max_gap)
        pos = self.steps - self._start
        in_trial = 0 <= pos < 2 * self.trial
        if in_trial:   # alternating, so a drift over the trial's steps favours neither
            way = pos % 2 == 0
        else:
            way = self._kept()
        self._trial_step = (now, way) if in_trial else None
        self._kept_poll_at = now if way and not in_trial and self.last_trial is not None else None
        self.steps += 1
        self.polled += way
        return way

    def _hold_polling_to_its_promise(self) -> None:
        """`guard` polled steps are in: block until the next trial if their median is
        longer than the last trial's blocked steps."""
        assert self.last_trial is not None
        median = statistics.median(self._guarded)
        self._guarded = []
        if median > self.last_trial[1]:
            self.chosen = False
            self.given_up += 1
            self.last_guard = median

    def _kept(self) -> bool:
        """The way steps outside a trial take: the last trial's winner, else the first choice."""
        return self.first.poll if self.chosen is None else self.chosen

    def describe(self) -> str:
        """summary.json's `comm_wait`: the way most steps took, then the evidence."""
        most = "poll" if 2 * self.polled > self.steps else "block"
        text = f"{most}: tuned, {self.polled} of {self.steps} steps polled"
        if self.last_trial is not None:
            poll_s, block_s = self.last_trial
            probe = "" if self.last_probe is None else f", probe {self.last_probe:.2f}"
            text += (f" (last trial: {poll_s * 1e3:.2f} ms per step polling, "
                     f"{block_s * 1e3:.2f} blocking{probe})")
        if self.last_guard is not None:   # set when polling was given up (given_up >= 1)
            text += (f"; polling given up {self.given_up} time{'s' * (self.given_up != 1)} "
                     f"between trials (its steps took {self.last_guard * 1e3:.2f} ms)")
        return f"{text}; at first {self.first.describe()}"
