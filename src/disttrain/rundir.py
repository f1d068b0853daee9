"""The run directory contract: what a run leaves in `train.run_dir`, and who writes it.

    run_dir/
      job.yaml        the resolved spec (written by the launcher before any rank starts)
      metrics.jsonl   one JSON record per line: train losses per rank, eval per epoch
      checkpoints/    ckpt-<step>.pt + .manifest.json, last.pt, dcp-<step>/ under FSDP (train/checkpoint.py)
      summary.json    the run's settings and results, written once at the end
      loss.png        training loss per optimizer step, one line per rank
      logs/           the tee'd rank logs of a user script run under torchrun, and torchrun.log:
                      torch's agent's own report of a failed worker (launch/agent_logs.py)
      live/           rank-<R>.json: each rank's latest figures (a script's also rank-<R>.jsonl,
                      merged into metrics.jsonl at the end: monitor/script_live.py)

    runs/<script stem>/run-1, run-2, ...   a user script's attempts, each its own run dir
    runs/<script stem>/latest              -> the newest attempt
      tb/             TensorBoard event files, when tensorboard is installed (docs/monitoring.md)
      report.png      `disttrain report RUN_DIR`: loss, samples/s, step-time breakdown per rank

    spec_path = prepare_run_dir(run_dir, spec.to_yaml(), clear=True, note=print)
    writer = open_writer(run_dir, spec.to_yaml())   # rank 0 only

A new run of the built-in job replaces an earlier run's outputs (`RUN_OUTPUTS`) unless it
resumes it; job.yaml is rewritten, other files in the folder are left alone. A user
script's run never deletes anything: each attempt gets a new folder (`next_attempt_dir`).
Only rank 0 writes (`RunWriter` is created on rank 0 alone); other ranks' numbers reach
it through collectives.
metrics.jsonl is appended and flushed as training goes so that `tail -f` follows a live
run. Every file is replaced atomically (a temporary name, then a rename), so a reader
never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.errors import Failure

JOB_YAML = "job.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"
LOSS_PNG = "loss.png"
LOGS = "logs"
TB = "tb"                  # TensorBoard event files, when tensorboard is installed (monitor/tensorboard.py)
REPORT_PNG = "report.png"  # `disttrain report` (monitor/report.py)
LIVE = "live"              # each rank's live status and the straggler verdict (train/telemetry.py)
LIVE_STRAGGLER = "straggler.json"   # in LIVE: rank 0's straggler verdict (train/telemetry.py)
RANKS_JSON = "ranks.json"  # where each rank of the current round runs (resilience/ranks.py)
STOP_JSON = "stop.json"    # rank 0's record of a clean stop on SIGTERM (resilience/preemption.py)
FAILURES = "failures"      # rank-<R>.json: each failed rank's typed failure (errors.Failure; worker.py)
# What a run produces, so what a new run (not --resume) in the same folder replaces.
RUN_OUTPUTS = (METRICS, SUMMARY, LOSS_PNG, CHECKPOINTS, LOGS, TB, REPORT_PNG, LIVE, RANKS_JSON,
               STOP_JSON, FAILURES)


# A user script's attempts: <base>/run-1, run-2, ... and <base>/latest -> the newest one
ATTEMPT_PREFIX = "run-"
LATEST = "latest"


def next_attempt_dir(base: Path) -> Path:
    """Where a user script's next attempt goes: `<base>/run-<N+1>` after the highest N
    there (nothing is created: `prepare_run_dir` does that once the job can start).

    A script's outputs are its logs, which a new attempt must not delete (Lightning's
    `version_N` folders, torchx's app ids): each attempt gets its own folder instead.
    """
    base = Path(base)
    try:
        taken = [int(p.name[len(ATTEMPT_PREFIX):]) for p in base.glob(f"{ATTEMPT_PREFIX}*")
                 if p.name[len(ATTEMPT_PREFIX):].isdigit()] if base.is_dir() else []
    except OSError:  # an unusable folder: the run dir's own check names it before any write
        taken = []
    return base / f"{ATTEMPT_PREFIX}{max(taken, default=0) + 1}"


def mark_latest(attempt: Path) -> Path:
    """Point `<base>/latest` at `attempt` (a relative symlink, replaced atomically)."""
    attempt = Path(attempt)
    link = attempt.parent / LATEST
    tmp = attempt.parent / f".{LATEST}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(attempt.name, target_is_directory=True)
    os.replace(tmp, link)
    return link


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a run's checkpoints go (every rank computes the same path)."""
    return Path(run_dir) / CHECKPOINTS


def replace_earlier_run(run_dir: Path, note: Callable[[str], Any]) -> list[Path]:
    """Delete an earlier run's outputs from `run_dir`, saying so through `note` first.

    Returns:
        The paths removed (none when the folder holds no earlier run).
    """
    run_dir = Path(run_dir)
    old = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if old:
        note(f"note: {run_dir} holds an earlier run; replacing it "
             f"(use --resume to continue it instead)")
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return old


def prepare_run_dir(run_dir: Path, spec_yaml: str, clear: bool,
                    note: Callable[[str], Any]) -> Path:
    """Create `run_dir`, replace an earlier run's outputs when `clear`, write job.yaml.

    Every rank may write the same job.yaml atomically, which is harmless; only the caller
    that owns the outputs may pass `clear` (under `--launcher env` every rank is its own
    launcher, and a late one would delete rank 0's fresh outputs).

    Returns:
        The path of job.yaml, which the workers read.
    """
    run_dir = Path(run_dir)
    if clear and run_dir.exists():
        replace_earlier_run(run_dir, note)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / JOB_YAML
    write_text_atomic(spec_path, spec_yaml)
    return spec_path


def open_writer(run_dir: Path, spec_yaml: str) -> RunWriter:
    """Rank 0's writer; writes job.yaml too when no launcher did (the Trainer started by
    a user's own script under plain torchrun), so every run dir says what ran."""
    writer = RunWriter(run_dir)
    if not (writer.run_dir / JOB_YAML).exists():
        writer.write_spec(spec_yaml)
    return writer


class RunWriter:
    """Rank 0's writer for one run directory."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        from disttrain.monitor.tensorboard import open_events  # None without tensorboard

        self._events = open_events(self.run_dir / TB)

    def write_spec(self, yaml_text: str) -> None:
        write_text_atomic(self.run_dir / JOB_YAML, yaml_text)

    def log(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._metrics.write(json.dumps(r, separators=(",", ":")) + "\n")
        self._metrics.flush()
        if self._events:
            self._events.log(records)

    def truncate_after(self, step: int) -> None:
        """On resume: drop records logged after the checkpoint, they will be redone."""
        self._metrics.close()
        kept = [json.dumps(r) for r in read_metrics(self.metrics_path) if r.get("step", 0) <= step]
        write_text_atomic(self.metrics_path, "".join(line + "\n" for line in kept))
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        if self._events:
            self._events.truncate_after(step)

    def last_train_loss(self) -> float | None:
        """The mean over ranks of the training loss logged at the last logged step."""
        return last_train_loss(self.metrics_path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_text_atomic(self.run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")

    def plot_loss(self) -> Path | None:
        return plot_loss(self.metrics_path, self.run_dir / LOSS_PNG)

    def finish(self, summary: dict[str, Any]) -> None:
        """The end of a run: summary.json, loss.png (unless `envvars.NO_LOSS_PNG`),
        metrics.jsonl closed."""
        self.write_summary(summary)
        if not envvars.flag(envvars.NO_LOSS_PNG):
            self.plot_loss()
        self.close()

    def close(self) -> None:
        self._metrics.close()
        if self._events:
            self._events.close()


# -- typed failures: what a rank writes when it fails, what its launcher reads ----------------
def write_failure(run_dir: Path, failure: Failure) -> None:
    """The failed rank's record, `FAILURES/rank-<R>.json` (atomic). Best effort: a run dir
    this rank cannot write leaves the launcher only the exit status, as before typing."""
    folder = Path(run_dir) / FAILURES
    name = f"rank-{failure.rank}.json" if failure.rank is not None else f"pid-{failure.pid}.json"
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / name, json.dumps(failure.to_dict()) + "\n")


def read_failures(run_dir: Path) -> list[Failure]:
    """Every failure record in `run_dir` (none: [])."""
    found = []
    folder = Path(run_dir) / FAILURES
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                failure = Failure.from_dict(json.loads(path.read_text(encoding="utf-8")))
                if failure is not None:
                    found.append(failure)
    return found


def clear_failures(run_dir: Path) -> None:
    """Remove an earlier launch's records before a new one (a restart or --resume keeps
    the run dir), so they are never taken for this launch's."""
    shutil.rmtree(Path(run_dir) / FAILURES, ignore_errors=True)


def read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl, without a torn line: a run killed or out of disk space
    while appending leaves half a record at the end, which a resume drops and redoes."""
    records = []
    for line in read_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_train_loss(metrics_path: Path) -> float | None:
    """Mean of the ranks' train losses at the last step metrics.jsonl has records for."""
    train = [r for r in read_metrics(metrics_path) if r.get("split") == "train"]
    if not train:
        return None
    last_step = max(r["step"] for r in train)
    vals = [r["loss"] for r in train if r["step"] == last_step]
    return sum(vals) / len(vals)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def plot_loss(metrics_path: Path, out: Path) -> Path | None:
    """loss.png: training loss per optimizer step, one line per rank."""
    records = [r for r in read_metrics(metrics_path) if r.get("split") == "train"]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for rank in sorted({r["rank"] for r in records}):
        pts = sorted((r["step"], r["loss"]) for r in records if r["rank"] == rank)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"rank {rank}", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("loss per rank")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out
