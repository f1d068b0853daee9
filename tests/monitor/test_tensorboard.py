"""TensorBoard event files under RUN_DIR/tb/, read back with tensorboard's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.rundir import RunWriter

from .conftest import write_schema_run


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_the_run_writer_writes_every_record_as_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    src = tmp_path / "schema"
    write_schema_run(src, world=2, slow=1, steps=10)
    rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    writer = RunWriter(tmp_path / "run")
    writer.log(rows[:4])     # two flushes, as the Trainer makes them
    writer.log(rows[4:])
    writer.close()
    got = _scalars(tmp_path / "run" / "tb")
    train = [r for r in rows if r["split"] == "train"]
    for rank in (0, 1):
        mine = [r for r in train if r["rank"] == rank]
        assert got[f"loss/rank{rank}"] == [(r["step"], pytest.approx(r["loss"])) for r in mine]
        assert got[f"step_ms/compute/rank{rank}"] == [(r["step"], r["compute_ms"]) for r in mine]
        assert got[f"samples_per_s/rank{rank}"] == [(r["step"], r["samples_per_s"]) for r in mine]
    assert got["lr"] == [(5, pytest.approx(0.01)), (10, pytest.approx(0.01))]
    assert got["eval/accuracy"] == [(10, pytest.approx(0.91))] and "eval/loss" in got
    assert {t.split("/")[1] for t in got if t.startswith("step_ms/")} == {
        "step", "data", "compute", "comm_wait", "optimizer", "other"}


def test_a_step_is_one_event_not_one_per_scalar(tmp_path: Path) -> None:
    """Without TensorFlow, tensorboard opens and closes the event file for every event: a
    flush of 50 records of 2 ranks as one event per scalar (~1,900) held rank 0 for 58-70
    ms; one event per step: 7-8 ms (docs/performance.md)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    src = tmp_path / "schema"
    write_schema_run(src, world=2, slow=1, steps=10)
    rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    writer = RunWriter(tmp_path / "run")
    writer.log(rows)
    writer.close()
    (events_file,) = (tmp_path / "run" / "tb").glob("events.out.tfevents.*")
    summaries = [e for e in EventFileLoader(str(events_file)).Load() if e.HasField("summary")]
    steps = {r["step"] for r in rows}
    assert sorted(e.step for e in summaries) == sorted(steps)     # one event per step
    assert sum(len(e.summary.value) for e in summaries) > 4 * len(steps)


def test_without_tensorboard_nothing_is_written(tmp_path: Path, monkeypatch) -> None:
    import disttrain.monitor.tensorboard as tb

    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: None)
    writer = RunWriter(tmp_path)
    writer.log([{"split": "train", "rank": 0, "epoch": 0, "step": 1, "loss": 1.0, "lr": 0.1}])
    writer.close()
    assert writer._events is None and not (tmp_path / "tb").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_a_resume_drops_the_events_after_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    row = {"split": "train", "rank": 0, "epoch": 0, "lr": 0.1}
    writer = RunWriter(tmp_path)
    writer.log([{**row, "step": 5, "loss": 2.0}, {**row, "step": 10, "loss": 1.0}])
    writer.close()
    writer = RunWriter(tmp_path)          # restarted from the checkpoint of step 5
    writer.truncate_after(5)
    writer.log([{**row, "step": 10, "loss": 1.5}])
    writer.close()
    assert _scalars(tmp_path / "tb")["loss/rank0"] == [(5, 2.0), (10, 1.5)]
