"""The run directory contract: job.yaml, metrics.jsonl, loss.png, summary.json.

Only rank 0 writes (`RunWriter` is created on rank 0 alone); other ranks' numbers reach
it through collectives. metrics.jsonl is appended and flushed as training goes so that
`tail -f` follows a live run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RunWriter:
    """Rank 0's writer for one run directory."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115

    def write_spec(self, yaml_text: str) -> None:
        write_text_atomic(self.run_dir / "job.yaml", yaml_text)

    def log(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._metrics.write(json.dumps(r, separators=(",", ":")) + "\n")
        self._metrics.flush()

    def truncate_after(self, step: int) -> None:
        """On resume: drop records logged after the checkpoint, they will be redone."""
        self._metrics.close()
        kept = [line for line in read_lines(self.metrics_path)
                if json.loads(line).get("step", 0) <= step]
        write_text_atomic(self.metrics_path, "".join(line + "\n" for line in kept))
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def plot_loss(self) -> Path | None:
        return plot_loss(self.metrics_path, self.run_dir / "loss.png")

    def close(self) -> None:
        self._metrics.close()


def read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_lines(path)]


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
