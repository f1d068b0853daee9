"""Modules the built-in job's workers need, imported once in a warm fork server.

`disttrain run` starts multiprocessing's fork server at the very beginning, with this
module as its preload (`disttrain.launch.forkserver.prewarm_workers`), so the server
imports torch and torch._dynamo (DDP and every optimizer import it on first use: ~1.1 s
here) on one core while the launcher imports torch on the other. torchrun's agent then
starts the workers with start_method "forkserver": each worker is a fork of the warm
server and starts training at once. The server never touches CUDA, so its forks may use
GPUs.

When the launcher names the job's task (`envvars.WARM_TASK`: its reference and
task_args, for disttrain's own tasks), the server runs the task's warm hook
(`disttrain.train.task.warm_task`), which loads its data, in a thread, while it imports
torch._dynamo: the launcher is done with its own import by then and
leaves a core idle. The forks share that one copy read-only (60,000 x 784 synthetic
samples: 0.45 s and 190 MB less per worker). The data is made with one intra-op thread,
so the server has no OpenMP team when it forks, and the thread is joined before the
server forks anyone.
"""

import atexit
import json
import os
import sys
import threading

import torch

from disttrain import envvars

# A local read or generation; past this the server stops waiting and forks without it.
WARM_TASK_TIMEOUT_S = 120.0


def _start_warm_task() -> threading.Thread | None:
    text = os.environ.pop(envvars.WARM_TASK, None)
    if not text:
        return None
    from disttrain.train.task import warm_task

    task = json.loads(text)
    torch.set_num_threads(1)  # each worker sets its own count in runtime.setup
    thread = threading.Thread(target=warm_task, args=(task["ref"], task["args"]),
                              name="disttrain-warm-task", daemon=True)
    thread.start()
    return thread


_warming = _start_warm_task()

import torch._dynamo  # noqa: E402
import torch.distributed  # noqa: E402
import torch.nn.parallel  # noqa: E402

import disttrain.train.build  # noqa: E402
import disttrain.worker  # noqa: E402, F401
from disttrain.resilience.watchdog import exit_now  # noqa: E402

if _warming is not None:
    _warming.join(WARM_TASK_TIMEOUT_S)
    if _warming.is_alive():
        print(f"disttrain: the fork server's warm-up of the task's data took over "
              f"{WARM_TASK_TIMEOUT_S:.0f} s; "
              "workers load their own", file=sys.stderr)

# The server's last act: it ends when its launcher does (the launcher closes its pipe), and
# the interpreter's teardown of torch would then keep it (and so the launcher's stdout and
# stderr, which it shares) alive for another 0.4-0.7 s (`disttrain.cli.main.entry`).
# atexit runs handlers last-registered first: this one, registered after the imports above,
# runs after anything registered later and before what torch and multiprocessing
# registered, which have nothing to do in a process that only forked.
atexit.register(exit_now, 0)
