"""A heartbeat for an unmodified user script: `python script.py`, with its progress watched.

    python -u -m disttrain.resilience.script_heartbeat --timeout-s 300 train.py --lr 0.01
    # = python -u train.py --lr 0.01, and the rank is watched from its process group's creation

Why: `--timeout-s` promises that a stuck rank ends the job by name, but the watchdog
(`disttrain.resilience.watchdog`) can only judge ranks that publish a heartbeat, and a
user's own `train.py` does not call disttrain. torch offers global hooks: on every
optimizer's `step()` (`torch.optim.optimizer.register_optimizer_step_post_hook`) and on
every module's forward (`register_module_forward_pre_hook`), and `torch.distributed` is
a namespace whose `init_process_group` and collectives can be wrapped
(`resilience.script_probes`). So `disttrain run` starts each script rank through this
entry, which installs those hooks and then runs the script as `python script.py` would
(`runpy.run_path` under `__main__`, the same arguments, `sys.path[0]` the script's folder,
the same exit status and traceback; `sys.argv[0]` is the script's absolute path, as
`__file__` is).

What counts as progress (docs/resilience.md, "Scripts"): an optimizer step, a forward
pass, entering or leaving a collective. Watching starts when the process group is created
(or at the first optimizer step of a script without one), so a rank that hangs before its
first step is named too; a script that never creates a group nor steps an optimizer never
publishes and is never judged. A rank waiting inside a collective is judged by whether
the rank it waits for progresses (rank 0's long evaluation is not a deadlock of the
others). The first gradient of a step marks `backward` (a hook on the stepped optimizer's
last parameter, as the built-in Trainer's `Heartbeat.attach`), so a rank waiting in DDP's
all-reduce is told apart from the one it waits for. A script that starts disttrain's own
heartbeat (the Trainer) keeps that one.

Also from the same hooks: live files in the run dir (`--run-dir`, given by `disttrain
run`: `monitor.script_live`), and a script that starts its own workers with `mp.spawn`
runs with plain python's environment, its workers watched (`resilience.spawned`).

torch is not imported here: the hooks are installed when the script itself has imported
`torch` (an import hook), so the environment the script sets up before its `import torch`
(OMP_NUM_THREADS, ...) is still read by torch as under plain python.
Under plain torchrun (a pod) nobody else watches: rank 0 then watches every rank and rank
1 watches rank 0, as `python -m disttrain.worker` does (`watchdog.in_job_watchdog`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType, TracebackType
from typing import Any, NoReturn

from disttrain.resilience import heartbeat

MODULE = "disttrain.resilience.script_heartbeat"  # = launch.argv.SCRIPT_ENTRY
_TORCH = "torch"


class ScriptHeartbeat:
    """The hooks of one script rank: the heartbeat starts when the process group exists
    (or at the first optimizer step), then every step, forward and collective beats it
    (attribute writes only; daemon threads publish it and write the live files).

    Args:
        rank: the key this rank publishes under (torchrun's RANK; a spawned worker's index).
        timeout_s: the stall timeout.
        store: (host, port) of the store the watchdog reads, or None (memory only).
        run_dir: where to write live files (None: none).
    """

    def __init__(self, rank: int, timeout_s: float, store: tuple[str, int] | None,
                 run_dir: str | None = None) -> None:
        self.rank, self.timeout_s, self.store, self.run_dir = rank, timeout_s, store, run_dir
        self.steps = 0
        self.hb: heartbeat.Heartbeat | None = None
        self.live: Any = None
        self.probes: Any = None
        self._grad_hook: Any = None
        self._forward_hook: Any = None
        self._handles: list[Any] = []
        self._leave = False
        # step timing for the live files: perf_counter at a step's boundaries, sums per interval
        self._t_end = self._t_fwd = self._t_bwd = self._t_opt = 0.0
        self._sums = {"step": 0.0, "data": 0.0, "compute": 0.0, "comm_wait": 0.0,
                      "optimizer": 0.0, "timed": 0.0}
        self._loss: Any = None
        self._scaled = False

    # -- installing ------------------------------------------------------------------
    def install(self, optimizer_module: ModuleType) -> None:
        """Register the global hooks on every optimizer's step (`torch.optim.optimizer`)."""
        self._handles += [optimizer_module.register_optimizer_step_pre_hook(self._pre),
                          optimizer_module.register_optimizer_step_post_hook(self._post)]

    def install_torch(self, torch: ModuleType) -> None:
        """Everything, once `torch` is imported: the optimizer hooks, the probes of
        torch.distributed (`script_probes`), the loss as `.backward()` sees it."""
        from disttrain.resilience.script_probes import DistProbes

        self.install(sys.modules["torch.optim.optimizer"])
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            self.probes = DistProbes(self.mine, self.watch)
            self.probes.install(dist)
        if self.run_dir:
            self._watch_loss(torch)

    def _watch_loss(self, torch: ModuleType) -> None:
        """Keep the scalar the script calls `.backward()` on (read by the live thread once
        a second), unless a GradScaler scaled it (then it is not the loss)."""
        backward = torch.Tensor.backward
        hooks = self

        def tensor_backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if tensor.dim() == 0:
                hooks._loss = tensor.detach()
            return backward(tensor, *args, **kwargs)

        torch.Tensor.backward = tensor_backward
        self._handles.append(_Restore(torch.Tensor, "backward", backward))
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler is not None:
            scale = scaler.scale

            def scaled(obj: Any, outputs: Any) -> Any:
                hooks._scaled = True
                return scale(obj, outputs)

            scaler.scale = scaled
            self._handles.append(_Restore(scaler, "scale", scale))

    # -- the watch -----------------------------------------------------------------------
    def mine(self) -> heartbeat.Heartbeat | None:
        """Our heartbeat while it is the process's current one (the script may start the
        Trainer's, which then does its own marking)."""
        return self.hb if self.hb is not None and heartbeat.current() is self.hb else None

    def watch(self) -> None:
        """Start the heartbeat (idempotent): at the process group's creation or the first
        optimizer step; leave it to disttrain's own when the Trainer runs one."""
        if self.hb is not None or self._leave:
            return
        if heartbeat.current() is not None:
            self._leave = True  # disttrain's own heartbeat runs (the Trainer): it marks
            return
        self.hb = heartbeat.start(self.rank, self.timeout_s, self.store)
        self.hb.probe = _MainThreadMoves()
        from disttrain.resilience.script_probes import FirstForward

        self._forward_hook = FirstForward(self.forward_started)
        self._forward_hook.arm()
        self._t_end = time.perf_counter()
        if self.run_dir:
            from disttrain.monitor.script_live import ScriptLive

            self.live = ScriptLive(self.run_dir, *_rank_and_size(self.rank), self.figures).start()

    def forward_started(self) -> None:
        """A step's first forward (`script_probes.FirstForward`): the data part ends."""
        hb = self.mine()
        if hb is not None:
            self._t_fwd = time.perf_counter()
            hb.seq += 1
            if hb.phase == "data" or hb.phase == "setup":
                hb.phase = "forward"

    def figures(self) -> tuple[int, dict[str, float], float | None] | None:
        """Steps so far, the parts' seconds summed since the last call over `timed` steps
        (all but the first), the last loss; None once the Trainer's own heartbeat took
        over (it writes the live files then)."""
        if self.mine() is None:
            return None
        sums, self._sums = self._sums, dict.fromkeys(self._sums, 0.0)
        loss = None
        if self._loss is not None and not self._scaled:
            with contextlib.suppress(Exception):
                loss = round(float(self._loss.item()), 6)
        if sums["data"] == 0.0 and sums["compute"] == 0.0:   # no forward seen: no split
            sums = {k: sums[k] for k in ("step", "optimizer", "timed")}
        return self.steps, sums, loss

    # -- the hooks -------------------------------------------------------------------------
    def _pre(self, optimizer: Any, *_: Any) -> None:
        self._t_opt = time.perf_counter()
        hb = self.mine()
        if hb is not None:
            hb.mark("optimizer")

    def _post(self, optimizer: Any, *_: Any) -> None:
        self.steps += 1
        if self.hb is None:
            self.watch()
            if self.hb is not None:
                self._attach(optimizer)
        elif self._grad_hook is None and self.mine() is not None:
            self._attach(optimizer)
        t = time.perf_counter()
        sums = self._sums
        if self.steps > 1:   # the first step's "data" holds the setup (DDP's, imports): left out
            sums["timed"] += 1
            sums["step"] += t - self._t_end
            sums["optimizer"] += t - self._t_opt
            if self._t_fwd:   # forward .. first gradient .. optimizer (monitor.script_live)
                sums["data"] += self._t_fwd - self._t_end
                bwd = self._t_bwd if self._t_bwd > self._t_fwd else self._t_opt
                sums["compute"] += bwd - self._t_fwd
                sums["comm_wait"] += self._t_opt - bwd
        self._t_end, self._t_fwd, self._t_bwd = t, 0.0, 0.0
        hb = self.mine()
        if hb is not None and self._forward_hook is not None:
            self._forward_hook.arm()
        if hb is not None:
            # `steps` optimizer steps done, the next batch not yet in a forward: a rank
            # that stops here is behind one already in the next forward (its collective)
            hb.beat(self.steps, "data")

    def _attach(self, optimizer: Any) -> None:
        """Mark `backward` at the first gradient of each step: the hook on the optimizer's
        last parameter (normally the first whose gradient is ready)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if params and hasattr(params[-1], "register_post_accumulate_grad_hook"):
            with contextlib.suppress(RuntimeError):
                self._grad_hook = params[-1].register_post_accumulate_grad_hook(
                    lambda _: self._mark_backward())

    def _mark_backward(self) -> None:
        if not self._t_bwd:   # the step's first gradient (several with accumulation)
            self._t_bwd = time.perf_counter()
        hb = self.mine()
        if hb is not None:
            hb.mark("backward")

    def stop(self) -> None:
        """The script ended: publish `done` (never judged), stop publishing, remove the hooks."""
        if self.live is not None:
            self.live.stop()
        if self.probes is not None:
            self.probes.remove()
        for handle in (*self._handles, self._grad_hook, self._forward_hook):
            if handle is not None:
                handle.remove()
        self._handles, self._grad_hook, self._forward_hook = [], None, None
        if self.mine() is not None:
            heartbeat.stop()


class _MainThreadMoves:
    """Whether the script's main thread executes: it used CPU time (`MIN_CPU_S`) or its
    innermost Python frame moved since the last call, read by the heartbeat's thread once
    per interval. Imports, data loading, an evaluation, a pure-Python loop: all count; a
    rank asleep, blocked in a collective or waiting on a lock does neither
    (docs/resilience.md, "Scripts"). The CPU time catches a tight loop, whose sampled frame
    looks the same each time (the interpreter switches threads at the same instructions)."""

    MIN_CPU_S = 0.001

    def __init__(self) -> None:
        self.ident = threading.main_thread().ident
        self.last: tuple[int, int] | None = None
        try:
            self.clock: int | None = time.pthread_getcpuclockid(self.ident or 0)
            self.cpu = time.clock_gettime(self.clock)
        except (AttributeError, OSError):   # no per-thread CPU clock: the frame alone
            self.clock, self.cpu = None, 0.0

    def __call__(self) -> bool:
        frame = sys._current_frames().get(self.ident or 0)
        key = None if frame is None else (id(frame), frame.f_lasti)
        moved, self.last = key != self.last, key
        if self.clock is not None:
            with contextlib.suppress(OSError):
                cpu = time.clock_gettime(self.clock)
                moved = moved or cpu - self.cpu >= self.MIN_CPU_S
                self.cpu = cpu
        return moved


class _Restore:
    """A handle that puts an attribute back (`.remove()`, as torch's hook handles)."""

    def __init__(self, owner: Any, name: str, original: Any) -> None:
        self.owner, self.name, self.original = owner, name, original

    def remove(self) -> None:
        setattr(self.owner, self.name, self.original)


def _rank_and_size(fallback_rank: int) -> tuple[int, int]:
    """The process group's rank and size once it exists, else the launcher's."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return fallback_rank, int(os.environ.get("WORLD_SIZE", "1") or 1)


class _InstallOnImport:
    """A `sys.meta_path` finder (the protocol of importlib.abc.MetaPathFinder, whose import
    costs more than all of this module) that runs `install(module)` right after `torch`
    (the package: its submodules are all loaded by then) is executed."""

    def __init__(self, install: Callable[[ModuleType], None]) -> None:
        self.install = install

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TORCH:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, install = spec.loader, self.install
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_torch_imported(install: Callable[[ModuleType], None]) -> None:
    """`install(torch)` now when torch is imported already (a spawned worker), else right
    after the script imports it."""
    if _TORCH in sys.modules:
        install(sys.modules[_TORCH])
    else:
        sys.meta_path.insert(0, _InstallOnImport(install))


def _store(env: Any) -> tuple[str, int] | None:
    """The job's c10d store (torchrun's agent store at MASTER_ADDR:MASTER_PORT) when this
    is one rank of several, as `runtime.Runtime.store_address` decides."""
    if env is not None and env.launched and env.world_size > 1:
        return env.master_addr, env.master_port
    return None


def _script_traceback(exc: BaseException, script: str) -> TracebackType | None:
    """The exception's traceback from the script's first frame: what `python script.py`
    shows, without this entry's and runpy's frames."""
    tb, target = exc.__traceback__, os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    return tb or exc.__traceback__


def watched_worker(index: int, fn: Callable[..., Any], watch: dict[str, Any], *args: Any) -> None:
    """What a worker the script starts with mp.spawn runs (`resilience.spawned`): its
    hooks, publishing to the parent's store under its index, then the script's `fn`."""
    hooks = ScriptHeartbeat(index, watch["timeout_s"], tuple(watch["store"]), watch["run_dir"])
    when_torch_imported(hooks.install_torch)
    try:
        fn(index, *args)
    finally:
        hooks.stop()


def _own_workers(script: str, env: Any, timeout_s: float, run_dir: str | None) -> Any:
    """For a script that starts its own workers as the only rank (`disttrain run main.py
    --nproc-per-node 1`): plain python's environment and watched workers
    (`resilience.spawned`); None for any other script."""
    from disttrain.launch.own_workers import own_workers

    if (env is not None and env.world_size > 1) or not own_workers(script):
        return None
    import importlib

    from disttrain.resilience.spawned import OwnWorkers

    # by its module's name: run as `python -m`, this module is __main__, which a spawned
    # worker (a fresh interpreter) cannot unpickle a function from
    worker = importlib.import_module(MODULE).watched_worker
    own = OwnWorkers(timeout_s, worker, run_dir)
    own.clean_environment()
    return own


def run_script(script: str, args: Sequence[str], timeout_s: float,
               run_dir: str | None = None) -> int:
    """Run `script` as `python script.py args` would, its progress beating the heartbeat;
    returns the exit status `python script.py args` would end with (`sys.exit(code)`
    included; KeyboardInterrupt passes through)."""
    from disttrain.distributed.env import read_env
    from disttrain.errors import DistEnvError
    from disttrain.resilience.process_end import exit_status
    from disttrain.resilience.watchdog import unless_watched

    try:
        env = read_env()
    except DistEnvError:
        env = None  # the script's own process-group setup will say what is malformed
    if env is not None and env.worker:  # `ps` and the OOM killer's log tell the ranks apart
        from disttrain.resilience.proctitle import set_rank_title

        set_rank_title(env.rank, env.world_size)
    own = _own_workers(script, env, timeout_s, run_dir)
    hooks = ScriptHeartbeat(env.rank if env else 0, timeout_s, _store(env), run_dir)

    def install(torch: ModuleType) -> None:
        hooks.install_torch(torch)
        if own is not None:
            own.install(sys.modules["torch.multiprocessing"])

    when_torch_imported(install)
    whole_lines()
    # As `python script.py` has it: the script's folder first on sys.path, its absolute
    # path as `__file__` and in tracebacks (runpy also puts it in sys.argv[0])
    path = os.path.abspath(script)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    try:
        with unless_watched(env, timeout_s):  # a pod: ranks 0 and 1 watch
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        tb = _script_traceback(exc, script)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints exc's own
        return 1
    finally:
        hooks.stop()
        if own is not None:
            own.remove()
    return 0


def whole_lines() -> None:
    """Write stdout and stderr a line at a time, as live as `python -u` but never half a line.

    Why: the workers run under `python -u` (or `PYTHONUNBUFFERED=1`, set in most images), so
    `print("done on rank", 1)` reaches the file in four writes, and torch's tee
    (`TailLog.tail_logfile`, `readline` on a growing file) can read the line half written and
    print `[rank1]:done on rank ` and `[rank1]:1` as two lines, with another rank's line in
    between (seen in this project's CI). Line buffering on the text layer keeps each line one
    write, and still flushes at every newline, so nothing waits in a buffer.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a replaced stream may lack it
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(line_buffering=True, write_through=False)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Parse the entry's arguments, run the script, and end this process with its status
    as `python script.py` would, without the interpreter's teardown
    (`resilience.process_end`: a finished rank could abort there, and its job was reported
    failed). A non-daemon thread the script left running gets `--timeout-s` to end."""
    from disttrain.resilience.process_end import end_process

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="seconds without progress that make a rank stalled")
    parser.add_argument("--run-dir", default=None,
                        help="write live files (live/rank-R.json) into this run directory")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = parser.parse_args(argv)
    code = run_script(ns.script, ns.args, ns.timeout_s, ns.run_dir)
    end_process(code, thread_grace_s=ns.timeout_s, flush_files=True)


if __name__ == "__main__":
    main()
