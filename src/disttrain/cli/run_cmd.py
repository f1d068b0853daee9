"""`disttrain run`: the main job, a spec file, or a user script, on this machine.

    disttrain run                                   # SimpleNet on digits, DDP, 2 processes
    disttrain run -f job.yaml --epochs 3
    disttrain run train.py --nproc-per-node 2 -- --lr 0.01
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import click

from disttrain.cli.options import SpecFile, fail, job_overrides, load_spec, spec_options

RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "checkpoints", "logs")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("-f", "--file", "spec_file", type=SpecFile(),
              help="job spec YAML; flags override its fields")
@click.option("--dry-run", is_flag=True, help="print the resolved spec and torchrun command")
@spec_options([None, "launch", "train"])
def run(script: str | None, script_args: tuple[str, ...], spec_file: str | None,
        dry_run: bool, **kwargs: Any) -> None:
    """Train the built-in job (default: SimpleNet on digits, DDP over 2 processes),
    the job in a spec file, or SCRIPT under torchrun (arguments after `--`)."""
    overrides = job_overrides(script, script_args, kwargs)
    spec = load_spec(spec_file, overrides)
    if not dry_run:
        _prewarm(spec)
    if "master_port" in overrides or _file_sets_port(spec_file):
        spec.launch.port_explicit = True
    _check_inputs(spec)
    if dry_run:
        from disttrain.launch.argv import torchrun_argv

        click.echo(spec.to_yaml() + "---\n" + " ".join(
            torchrun_argv(spec, spec_path=str(spec.run_dir / "job.yaml"))))
        return
    raise click.exceptions.Exit(_run(spec))


def _prewarm(spec: Any) -> None:
    """Start the workers' warm fork server now, before this process imports torch, and
    let it load the job's dataset once for all local workers (`disttrain.launch.forkserver_preload`)."""
    if spec.launch.launcher != "torchrun" or spec.script:
        return
    import os

    from disttrain.launch.argv import resolve_nproc
    from disttrain.launch.launchers import prewarm_workers, worker_env

    # What the workers will inherit (OMP_NUM_THREADS), without asking torch how many GPUs
    # there are (gpus=0): that import is what the server overlaps.
    for k, v in worker_env(spec, resolve_nproc(spec, gpus=0)).items():
        os.environ.setdefault(k, v)

    cfg = spec.train
    prewarm_workers({"example": spec.workload, "data_dir": cfg.data_dir,
                     "num_samples": cfg.num_samples, "input_size": cfg.input_size})


def _file_sets_port(spec_file: str | None) -> bool:
    if not spec_file:
        return False
    import yaml

    data = yaml.safe_load(Path(spec_file).read_text()) or {}
    return isinstance(data.get("launch"), dict) and "master_port" in data["launch"]


def _check_inputs(spec: Any) -> None:
    """Refuse, before any process starts, what would only fail inside every worker."""
    if spec.script and not _is_file(spec.script):
        fail(f"script {spec.script[:300]}: no such file")
    if not spec.script:
        _check_strategy(spec)
    from disttrain.launch.argv import local_gpu_count

    if spec.train.precision == "fp16" and local_gpu_count() == 0 and not spec.script:
        fail("train.precision: fp16 autocast needs a CUDA GPU; on CPU use --precision bf16")
    if spec.launch.backend == "nccl" and local_gpu_count() == 0:
        fail("launch.backend: nccl needs CUDA GPUs and none is visible; use --backend gloo "
             "(or auto)")
    if spec.workload == "mnist" and not spec.train.download:
        from disttrain.train.data import DEFAULT_MNIST_DIR, find_mnist, mnist_candidates

        root = Path(spec.train.data_dir or DEFAULT_MNIST_DIR)
        if find_mnist(root) is None:
            looked = ", ".join(str(p) for p in mnist_candidates(root))
            fail(f"train.data_dir: MNIST IDX files not found in {looked}; put them there, "
                 f"pass --data-dir DIR, or add --download")


def _check_strategy(spec: Any) -> None:
    """Built-in job combinations that every worker would reject (or crash on) at start.

    Only for the built-in job: a user script reads its own arguments, not `train`.
    """
    cfg, nproc = spec.train, spec.launch.nproc_per_node
    if cfg.strategy == "dp" and isinstance(nproc, int) and nproc > 1:
        fail(f"launch.nproc_per_node: strategy dp runs ONE process that drives all visible "
             f"GPUs (nn.DataParallel), not {nproc}; use --nproc-per-node 1, or "
             f"--strategy ddp for one process per GPU (recommended)")
    if cfg.strategy == "dp" and spec.launch.nnodes > 1:
        fail(f"launch.nnodes: strategy dp is one process on one machine, not {spec.launch.nnodes} "
             f"nodes; use --strategy ddp across nodes")
    if cfg.strategy == "dp" and spec.launch.launcher == "env":
        from disttrain.distributed.runtime import read_env
        from disttrain.errors import DistEnvError

        try:
            world = read_env().world_size
        except DistEnvError as exc:
            fail(f"--launcher env: {exc}")
        if world > 1:
            fail(f"WORLD_SIZE={world}: strategy dp is ONE process that drives all visible GPUs "
                 f"(nn.DataParallel), so there is nothing for other ranks to do; set "
                 f"WORLD_SIZE=1, or use --strategy ddp (one process per GPU, recommended)")
    if cfg.strategy == "fsdp" and cfg.comm_hook == "powersgd":
        fail("train.comm_hook: powersgd is a DDP comm hook and FSDP has none; "
             "use --strategy ddp, or --comm-hook bf16/fp16 with fsdp")


def _is_file(path: str) -> bool:
    """Path.is_file that answers False for names the OS refuses (too long, NUL)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def _prepare_run_dir(spec: Any) -> Path:
    """Create the run dir (clearing an earlier run's outputs) and write job.yaml there.

    Every rank writes the same job.yaml atomically, which is harmless; only the rank
    that owns the outputs may delete them (see `_owns_outputs`).
    """
    run_dir = spec.run_dir
    if not spec.train.resume and run_dir.exists() and _owns_outputs(spec):
        old = [run_dir / n for n in RUN_OUTPUTS if (run_dir / n).exists()]
        if old:
            click.echo(f"note: {run_dir} holds an earlier run; replacing it "
                       f"(use --resume to continue it instead)")
        for path in old:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job.yaml"
    from disttrain.rundir import write_text_atomic

    write_text_atomic(spec_path, spec.to_yaml())
    return spec_path


def _owns_outputs(spec: Any) -> bool:
    """Whether this invocation may clear the run dir: always, except under `--launcher env`.

    With `env` every rank is its own `disttrain run` and they may share a run dir; a
    rank other than 0 that starts a moment later would delete rank 0's fresh outputs.
    """
    if spec.launch.launcher != "env":
        return True
    from disttrain.distributed.runtime import read_env
    from disttrain.errors import DistEnvError

    try:
        return read_env().rank == 0
    except DistEnvError as exc:
        fail(f"--launcher env: {exc}")


def _run(spec: Any) -> int:
    from disttrain.errors import LaunchError
    from disttrain.launch.launchers import launch

    spec_path = _prepare_run_dir(spec)
    try:
        result = launch(spec, spec_path)
    except LaunchError as exc:
        fail(str(exc))
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if result.exit_code != 0:
        _explain_failure(result)
    return result.exit_code


def _explain_failure(result: Any) -> None:
    ranks = ", ".join(str(r) for r in sorted(result.failures)) or "?"
    for stall in getattr(result, "stalls", []):  # the watchdog's finding names the cause
        click.echo(f"error: {stall}", err=True)
    click.echo(f"error: the job failed (failed rank(s): {ranks})", err=True)
    try:
        from disttrain.diagnose.logs import diagnose, format_diagnosis
    except ImportError:
        return
    click.echo(format_diagnosis(diagnose(result.log_text)), err=True)
