"""The run-directory contract: what a new run replaces, job.yaml, the writer's records."""

from __future__ import annotations

import json

from disttrain.rundir import (
    CHECKPOINTS,
    JOB_YAML,
    RUN_OUTPUTS,
    checkpoint_dir,
    mark_latest,
    next_attempt_dir,
    open_writer,
    prepare_run_dir,
    read_metrics,
)


def _earlier_run(run_dir):
    run_dir.mkdir()
    for name in ("metrics.jsonl", "summary.json", "loss.png"):
        (run_dir / name).write_text("old")
    (run_dir / CHECKPOINTS).mkdir()
    (run_dir / CHECKPOINTS / "last.pt").write_text("old")
    (run_dir / "notes.txt").write_text("the user's")


def test_a_new_run_replaces_an_earlier_runs_outputs_only(tmp_path):
    run_dir, notes = tmp_path / "run", []
    _earlier_run(run_dir)
    spec_path = prepare_run_dir(run_dir, "name: x\n", clear=True, note=notes.append)
    assert spec_path == run_dir / JOB_YAML and spec_path.read_text() == "name: x\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["job.yaml", "notes.txt"]
    assert notes == [f"note: {run_dir} holds an earlier run; replacing it "
                     f"(use --resume to continue it instead)"]


def test_without_clear_the_outputs_stay_and_nothing_is_said(tmp_path):
    run_dir, notes = tmp_path / "run", []
    _earlier_run(run_dir)
    prepare_run_dir(run_dir, "name: y\n", clear=False, note=notes.append)
    assert (run_dir / "metrics.jsonl").read_text() == "old" and notes == []
    assert (run_dir / CHECKPOINTS / "last.pt").exists()
    assert (run_dir / JOB_YAML).read_text() == "name: y\n"


def test_a_fresh_folder_is_created_without_a_note(tmp_path):
    notes: list[str] = []
    prepare_run_dir(tmp_path / "a" / "b", "name: x\n", clear=True, note=notes.append)
    assert (tmp_path / "a" / "b" / JOB_YAML).is_file() and notes == []


def test_outputs_and_checkpoint_folder_names():
    assert RUN_OUTPUTS == ("metrics.jsonl", "summary.json", "loss.png", "checkpoints", "logs",
                           "tb", "report.png", "live", "ranks.json", "stop.json", "failures")
    assert checkpoint_dir("runs/x").as_posix() == "runs/x/checkpoints"


def test_writer_keeps_the_launchers_job_yaml_and_writes_one_when_missing(tmp_path):
    launched = tmp_path / "launched"
    launched.mkdir()
    (launched / JOB_YAML).write_text("from the launcher\n")
    open_writer(launched, "from the trainer\n").close()
    assert (launched / JOB_YAML).read_text() == "from the launcher\n"
    bare = tmp_path / "bare"
    open_writer(bare, "from the trainer\n").close()
    assert (bare / JOB_YAML).read_text() == "from the trainer\n"


def test_writer_records_truncation_and_last_train_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_NO_LOSS_PNG", "")   # the suite turns the plot off
    w = open_writer(tmp_path, "x\n")
    assert w.last_train_loss() is None
    w.log([{"split": "train", "rank": r, "step": s, "loss": float(s + r)}
           for s in (1, 2, 3) for r in (0, 1)])
    w.log([{"split": "eval", "rank": -1, "step": 3, "loss": 9.0}])
    assert w.last_train_loss() == 3.5  # mean of the ranks' losses at step 3
    w.truncate_after(2)  # a resume from step 2 redoes step 3
    assert w.last_train_loss() == 2.5
    w.finish({"steps": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 2}
    assert (tmp_path / "loss.png").is_file()


def test_a_scripts_attempts_each_get_a_folder_and_latest_follows(tmp_path):
    base = tmp_path / "runs" / "train"
    first = next_attempt_dir(base)
    assert first == base / "run-1" and not base.exists()  # nothing created before the start
    prepare_run_dir(first, "name: train\n", clear=False, note=print)
    mark_latest(first)
    (base / "run-9").mkdir()
    (base / "run-x").mkdir()  # not an attempt number: ignored
    nxt = next_attempt_dir(base)
    assert nxt == base / "run-10"
    prepare_run_dir(nxt, "name: train\n", clear=False, note=print)
    link = mark_latest(nxt)
    assert link.is_symlink() and link.resolve() == nxt.resolve()
    assert (first / JOB_YAML).exists()  # the earlier attempt is left alone


def test_a_torn_last_record_is_dropped_on_resume(tmp_path):
    """A run killed or out of disk space mid-append leaves half a record; resuming must not
    fail on it (the chaos soak's full-disk case found this) and redoes that step."""
    writer = open_writer(tmp_path, "name: x\n")
    writer.log([{"split": "train", "step": 1, "loss": 1.0}, {"split": "train", "step": 2, "loss": 0.5}])
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"split": "train", "st')
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    writer = open_writer(tmp_path, "name: x\n")
    writer.truncate_after(1)
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"split": "train", "step": 1, "loss": 1.0}\n'


def test_no_loss_png_when_asked(tmp_path, monkeypatch):
    """DISTTRAIN_NO_LOSS_PNG (the suite sets it): the run ends with its summary, no plot."""
    monkeypatch.setenv("DISTTRAIN_NO_LOSS_PNG", "1")
    w = open_writer(tmp_path, "x\n")
    w.log([{"split": "train", "rank": 0, "step": 1, "loss": 1.0}])
    w.finish({"steps": 1})
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / "loss.png").exists()
