"""A heartbeat for an unmodified user script: `python script.py`, with its optimizer steps watched.

    python -u -m disttrain.resilience.script_heartbeat --timeout-s 300 train.py --lr 0.01
    # = python -u train.py --lr 0.01, and each optimizer step beats this rank's heartbeat

Why: `--timeout-s` promises that a stuck rank ends the job by name, but the watchdog
(`disttrain.resilience.watchdog`) can only judge ranks that publish a heartbeat, and a
user's own `train.py` does not call disttrain. torch offers a global hook on every
optimizer's `step()` (`torch.optim.optimizer.register_optimizer_step_post_hook`), so
`disttrain run` starts each script rank through this entry, which installs that hook and
then runs the script as `python script.py` would (`runpy.run_path` under `__main__`, the
same arguments, `sys.path[0]` the script's folder, the same exit status and traceback;
`sys.argv[0]` is the script's absolute path, as `__file__` is).

What counts as progress (docs/resilience.md): an optimizer step. The first step starts
the heartbeat, so a script that never steps an optimizer never publishes one and is
never judged (the watchdog only watches ranks that published). After it, a rank with no
optimizer step for `--timeout-s` is a stall; the first gradient of a step marks
`backward` (a hook on the stepped optimizer's last parameter, as the built-in Trainer's
`Heartbeat.attach`), so a rank waiting in DDP's all-reduce is told apart from the one it
waits for. A script that starts disttrain's own heartbeat (the Trainer) keeps that one.

torch is not imported here: the hook is installed when the script itself first imports
`torch.optim.optimizer` (an import hook), so the environment the script sets up before
its `import torch` (OMP_NUM_THREADS, ...) is still read by torch as under plain python.
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
from collections.abc import Sequence
from types import ModuleType, TracebackType
from typing import Any

from disttrain.resilience import heartbeat

MODULE = "disttrain.resilience.script_heartbeat"  # = launch.argv.SCRIPT_ENTRY
_OPTIMIZER_MODULE = "torch.optim.optimizer"


class ScriptHeartbeat:
    """The optimizer-step hooks of one script rank: start the heartbeat at the first
    step, then beat it at every step (attribute writes only; a daemon thread publishes)."""

    def __init__(self, rank: int, timeout_s: float, store: tuple[str, int] | None) -> None:
        self.rank, self.timeout_s, self.store = rank, timeout_s, store
        self.steps = 0
        self.hb: heartbeat.Heartbeat | None = None
        self._grad_hook: Any = None
        self._handles: list[Any] = []
        self._leave = False

    def install(self, optimizer_module: ModuleType) -> None:
        """Register the global hooks on every optimizer's step (`torch.optim.optimizer`)."""
        self._handles = [optimizer_module.register_optimizer_step_pre_hook(self._pre),
                         optimizer_module.register_optimizer_step_post_hook(self._post)]

    def _mine(self) -> heartbeat.Heartbeat | None:
        """Our heartbeat while it is the process's current one (the script may start the
        Trainer's, which then does its own marking)."""
        return self.hb if self.hb is not None and heartbeat.current() is self.hb else None

    def _pre(self, optimizer: Any, *_: Any) -> None:
        hb = self._mine()
        if hb is not None:
            hb.mark("optimizer")

    def _post(self, optimizer: Any, *_: Any) -> None:
        self.steps += 1
        if self.hb is None and not self._leave:
            if heartbeat.current() is not None:
                self._leave = True  # disttrain's own heartbeat runs (the Trainer): it marks
                return
            self.hb = heartbeat.start(self.rank, self.timeout_s, self.store)
            self._attach(optimizer)
        hb = self._mine()
        if hb is not None:
            # `steps` optimizer steps done, now in the next one's forward (the built-in
            # Trainer's `beat(step)` convention, which the watchdog's ordering assumes)
            hb.beat(self.steps, "forward")

    def _attach(self, optimizer: Any) -> None:
        """Mark `backward` at the first gradient of each step: the hook on the optimizer's
        last parameter (normally the first whose gradient is ready)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if params and hasattr(params[-1], "register_post_accumulate_grad_hook"):
            with contextlib.suppress(RuntimeError):
                self._grad_hook = params[-1].register_post_accumulate_grad_hook(
                    lambda _: self._mark_backward())

    def _mark_backward(self) -> None:
        hb = self._mine()
        if hb is not None:
            hb.mark("backward")

    def stop(self) -> None:
        """The script ended: publish `done` (never judged), stop publishing, remove the hooks."""
        for handle in (*self._handles, self._grad_hook):
            if handle is not None:
                handle.remove()
        self._handles, self._grad_hook = [], None
        if self._mine() is not None:
            heartbeat.stop()


class _InstallOnImport:
    """A `sys.meta_path` finder (the protocol of importlib.abc.MetaPathFinder, whose import
    costs more than all of this module) that runs `hooks.install(module)` right after
    `torch.optim.optimizer` is executed."""

    def __init__(self, hooks: ScriptHeartbeat) -> None:
        self.hooks = hooks

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _OPTIMIZER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, hooks = spec.loader, self.hooks
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            hooks.install(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


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


def run_script(script: str, args: Sequence[str], timeout_s: float) -> int:
    """Run `script` as `python script.py args` would, its optimizer steps beating the
    heartbeat; returns the exit status (SystemExit passes through unchanged)."""
    from disttrain.distributed.env import read_env
    from disttrain.errors import DistEnvError
    from disttrain.resilience.watchdog import unless_watched

    try:
        env = read_env()
    except DistEnvError:
        env = None  # the script's own process-group setup will say what is malformed
    if env is not None and env.launched:  # `ps` and the OOM killer's log tell the ranks apart
        from disttrain.resilience.proctitle import set_rank_title

        set_rank_title(env.rank, env.world_size)
    hooks = ScriptHeartbeat(env.rank if env else 0, timeout_s, _store(env))
    sys.meta_path.insert(0, _InstallOnImport(hooks))
    # As `python script.py` has it: the script's folder first on sys.path, its absolute
    # path as `__file__` and in tracebacks (runpy also puts it in sys.argv[0])
    path = os.path.abspath(script)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    try:
        with unless_watched(env, timeout_s):  # a pod: ranks 0 and 1 watch
            runpy.run_path(path, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = _script_traceback(exc, script)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints exc's own
        return 1
    finally:
        hooks.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="seconds without an optimizer step that make a rank stalled")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = parser.parse_args(argv)
    return run_script(ns.script, ns.args, ns.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
