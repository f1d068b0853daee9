"""Fault injection for the resilience tests: make one rank fail at an exact step.

    disttrain run --max-restarts 1 ...    # with envvars.FAULT set to kill:rank=1:step=17

TESTING ONLY. The variable `envvars.FAULT` (docs/resilience.md) set to
`ACTION:rank=R:step=S[:phase=P][:restart=N]` makes rank R
kill (SIGKILL), stop (SIGSTOP), hang (sleep forever, alive), exit (exit code 3) or raise
when its heartbeat (`disttrain.resilience.heartbeat`) reaches optimizer step S, in phase P if given
(forward, backward, optimizer, between steps, checkpoint, eval, finish), during restart
round N (default 0, so a restarted job runs clean). The variable is read here alone, once
per process when the heartbeat starts; unset, it costs one `is None` test per beat.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from disttrain import envvars

FAULT_ACTIONS = ("kill", "stop", "hang", "exit", "raise")


@dataclass(frozen=True)
class Fault:
    """A failure to inject into one rank: see the module docstring (testing only)."""

    action: str
    rank: int
    step: int
    phase: str | None = None
    restart: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`kill:rank=1:step=17[:phase=backward][:restart=0]` -> Fault.

        Raises:
            ValueError: the text is malformed; the message shows the expected form.
        """
        usage = (f"{envvars.FAULT}={text!r}: expected ACTION:rank=R:step=S[:phase=P][:restart=N] "
                 f"with ACTION one of {', '.join(FAULT_ACTIONS)}")
        action, *parts = text.strip().split(":")
        values: dict[str, str] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in ("rank", "step", "phase", "restart"):
                raise ValueError(usage)
            values[key] = value
        if action not in FAULT_ACTIONS or "rank" not in values or "step" not in values:
            raise ValueError(usage)
        try:
            return cls(action, int(values["rank"]), int(values["step"]),
                       values.get("phase") or None, int(values.get("restart", "0")))
        except ValueError:
            raise ValueError(usage) from None

    @classmethod
    def from_env(cls) -> Fault | None:
        text = os.environ.get(envvars.FAULT, "")
        return cls.parse(text) if text else None

    def fire(self, where: str, flush: Callable[[], None] | None = None) -> None:
        """Do the injected failure now, in this process.

        `stop` first publishes the heartbeat (`flush`), as a rank that had been stuck
        in one place for a while would have; a process frozen within one publishing
        interval of its last move is reported where it was last seen.
        """
        print(f"disttrain fault injection (testing only): {self.action} rank {self.rank} "
              f"pid {os.getpid()} at {where} t={time.time():.3f}", file=sys.stderr, flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            if flush is not None:
                flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "hang":
            while True:
                time.sleep(3600)
        elif self.action == "exit":
            os._exit(3)
        else:
            raise RuntimeError(f"disttrain fault injection: rank {self.rank} at {where}")
