"""The straggler view under pipeline parallel on a real run (issue 26 item 4): the Trainer on
four gloo ranks, chargpt at pp=2 x dp=2 (1F1B, 2 micro-batches), rank 3 (stage 2, dp
replica 2) slowed 5x on purpose (`resilience/faults.py`'s slow-compute). What must hold:

- every rank's place in the mesh is in its live file, in summary.json's `ranks` and in
  `disttrain report`'s table ("stage 2 of 2, dp 2 of 2");
- the verdict names a rank of the slowed pipeline (dp replica 2: ranks 1 and 3) against
  its own stage, with its stage. Which of the two has the most excess is not fixed: rank 1
  (stage 1) waits for rank 3's gradients inside its schedule step, which the step timer
  counts as compute, so both stand out in their stages by about the injected sleep
  (measured on a quiet machine: compute 15.2 / 32.7 / 14.3 / 32.8 ms on ranks 0-3, rank 3
  named at 2.3x, the other of the two in its message as "its pipeline's ..."); the fast
  replica (ranks 0, 2) is never named. A 3x slowdown stood out by only 1.75-2.05x on a quiet
  machine (the pipeline's waits are in every rank's compute) and once, in a clean-clone
  suite, by less than the 1.5x threshold: 5x leaves the margin (2.3-2.6x quiet, 5-15x with
  busy processes beside it).

This run does not tell the per-stage rule from the plain one (chargpt's two stages cost
about the same here, and the plain rule named rank 1 too): the expected-imbalance cases
are tests/monitor/test_straggler_stages.py's. No timing assertion: only who is named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain import envvars
from disttrain.testing import run_ranks, setup_for_test

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, EVERY = 20, 5


def _fit(run_dir: str) -> dict:
    from disttrain.spec.job import JobSpec
    from disttrain.train.build import build_trainer

    data = {"example": "chargpt", "task_args": {"block": 16, "layers": 2, "width": 32, "heads": 4}}
    overrides = {"batch_size": 4, "epochs": 1, "max_steps": STEPS, "log_every_steps": EVERY,
                 "checkpoint_every_epochs": 0, "run_dir": run_dir, "pp": 2, "microbatches": 2,
                 "optimizer": "sgd", "lr": 0.1}
    with setup_for_test() as rt:
        return build_trainer(JobSpec.from_dict(data, overrides), rt).fit()


@pytest.fixture(scope="module")
def slowed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    run_dir = tmp_path_factory.mktemp("pp-straggler") / "run"
    results = run_ranks(4, _fit, str(run_dir), timeout_s=200,
                        env={envvars.FAULT: "slow-compute:rank=3:factor=5"})
    return results[0], run_dir


def test_each_ranks_stage_is_in_the_summary_and_the_live_files(slowed):
    summary, run_dir = slowed
    places = {r["rank"]: r.get("mesh") for r in summary["ranks"]}
    assert places == {0: {"pp": [0, 2], "dp_shard": [0, 2]}, 1: {"pp": [0, 2], "dp_shard": [1, 2]},
                      2: {"pp": [1, 2], "dp_shard": [0, 2]}, 3: {"pp": [1, 2], "dp_shard": [1, 2]}}
    for rank, place in places.items():
        live = json.loads((run_dir / "live" / f"rank-{rank}.json").read_text())
        assert live["mesh"] == place and live["done"]


def test_the_slowed_pipeline_is_named_against_its_own_stage(slowed):
    summary, _ = slowed
    v = summary["straggler"]
    assert v is not None, summary["ranks"]
    assert v["cause"] == "compute" and v["rank"] in (1, 3), v
    assert v["stage"] == v["rank"] // 2 + 1
    assert set(v["pipeline"]) <= {1, 3} and v["rank"] in v["pipeline"], v
    place = f"stage {v['stage']} of 2, dp 2 of 2"
    assert v["message"].startswith(f"rank {v['rank']} ({place}, host "), v["message"]
    assert "than the median rank of its stage" in v["message"]


def test_report_shows_each_ranks_place(slowed):
    from rich.console import Console

    from disttrain.monitor.report import load_report, plot_report, summary_tables

    _, run_dir = slowed
    rep = load_report(run_dir)
    assert plot_report(rep).stat().st_size > 0   # its bars are labelled "rank 3 · stage 2 of 2"
    console = Console(record=True, width=220)
    console.print(summary_tables(rep))
    rows = {line.split()[0]: " ".join(line.split()) for line in console.export_text().splitlines()
            if line.split() and line.split()[0].isdigit()}
    assert "stage 1 of 2, dp 1 of 2" in rows["0"] and "stage 2 of 2, dp 2 of 2" in rows["3"], rows
