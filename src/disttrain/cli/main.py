"""Entry point of the `disttrain` command.

    disttrain run                      # the built-in main job
    disttrain run train.py --nproc-per-node 2 -- --my-arg 1
    disttrain k8s render -f job.yaml
    disttrain verify | bench | doctor | lint | env

Sub-commands live in their own modules and are imported only when called, so
`disttrain --help` and bad-flag errors answer without importing torch.
"""

from __future__ import annotations

import importlib

import click

# verb -> "module:attribute" of the click command implementing it
COMMANDS: dict[str, str] = {
    "run": "disttrain.cli.run_cmd:run",
    "k8s": "disttrain.cli.k8s_cmd:k8s",
    "verify": "disttrain.cli.verify_cmd:verify",
    "bench": "disttrain.cli.bench_cmd:bench",
    "doctor": "disttrain.cli.doctor_cmd:doctor",
    "lint": "disttrain.cli.lint_cmd:lint",
    "env": "disttrain.cli.env_cmd:env",
    "top": "disttrain.cli.top_cmd:top",
    "report": "disttrain.cli.report_cmd:report",
    "plan": "disttrain.cli.plan_cmd:plan",
    "finetune": "disttrain.cli.finetune_cmd:finetune",
}

HELP = {
    "run": "Train: the built-in main job, a spec (-f) or your script, via torchrun.",
    "k8s": "Kubernetes (K3s + HAMi): render, apply, status, logs, delete, run-local, verify, top.",
    "verify": "Check the distributed setup: collectives, gradient sync, convergence.",
    "bench": "Benchmarks: allreduce bandwidth, scaling, Trainer overhead.",
    "doctor": "Preflight checks of this machine; `doctor logs` explains a failed job.",
    "lint": "Check a training script against the distributed-training checklist.",
    "env": "Print a copy-pasteable report of the environment.",
    "top": "Watch a running job's ranks live: samples/s, loss, step-time breakdown, straggler.",
    "report": "A finished run in pictures (report.png) and a table: loss, speed, straggler.",
    "plan": "A job's GPU memory per rank and the HAMi slice (gpumem) to request, before launch.",
    "finetune": "Fine-tune a pretrained LM from a local directory: LoRA or full, saved in HF format.",
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            if ctx.resilient_parsing:  # `--help` listing: show the verb anyway
                return click.Command(cmd_name, help=HELP[cmd_name])
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP[name]) for name in COMMANDS])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="disttrain")
def cli() -> None:
    """disttrain: PyTorch distributed training, correct and fast, local and on K3s + HAMi."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: returns the exit code instead of raising SystemExit."""
    _mark_start()
    try:
        cli.main(args=argv, prog_name="disttrain", standalone_mode=True)
    except SystemExit as exc:
        from disttrain.resilience.process_end import exit_status

        return exit_status(exc)
    return 0


def entry() -> None:
    """The `disttrain` command (console script and `python -m disttrain.cli.main`): `main`,
    then `resilience.process_end.end_process`: what a normal exit does that matters
    (non-daemon threads joined, atexit handlers), without the interpreter's teardown of
    every module, which after `import torch` alone costs 0.4-0.75 s of CPU, paid by every
    command and by whoever waits on its output pipe."""
    import sys

    from disttrain.resilience.process_end import end_process

    code = 1
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except BaseException:   # a bug in disttrain: say so, with where it is (never exit 1 mutely)
        import traceback

        traceback.print_exc()
        print("error: disttrain failed unexpectedly (the traceback above); please report it",
              file=sys.stderr, flush=True)
    end_process(code)


def _mark_start() -> None:
    """`envvars.T0`: this command's start time, so workers can report time-to-first-step."""
    import os
    import time

    from disttrain import envvars

    if envvars.T0 not in os.environ:
        try:
            with open(f"/proc/{os.getpid()}/stat") as f:
                start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            t0 = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            t0 = time.time()
        envvars.set_env(envvars.T0, repr(t0))


if __name__ == "__main__":
    entry()
