"""The interleaved pipeline schedule (issue 26 item 1): `disttrain run --example chargpt --pp 2
--pp-schedule interleaved-1f1b` on two gloo ranks (torch's ScheduleInterleaved1F1B: each rank
holds two model chunks, rank r stages r and r + 2 of 4) trains the same model as one process,
and a run killed mid-way resumes to the same parameters.

The job is test_parallel_trainer.py's tiny chargpt with 4 blocks instead of 2 (4 stages need
4 blocks to cut at): 30 SGD steps of 8 windows in 4 micro-batches, a checkpoint every 10
steps (the step-30 .pt holds the consolidated weights, under the model's own names).
Tolerance against one process: rtol 1e-4, atol 5e-5 (fp32; the micro-batches sum in another
order than one process does; measured: losses within 9.5e-7, parameters within 1.4e-6).
Resumed against the uninterrupted run: bitwise. About 90 s on 2 CPU cores.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.distributed.conftest import (
    CHARGPT_JOB,
    CHARGPT_STEPS,
    final_weights,
    rank_losses,
    run_chargpt,
    summary_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("no_stray_workers")]

STEPS = CHARGPT_STEPS
_ARGS = list(CHARGPT_JOB)
_ARGS[_ARGS.index("--task-args") + 1] = '{"block": 16, "layers": 4, "width": 32, "heads": 4}'
JOB = (*_ARGS, "--batch-size", "8")
INTERLEAVED = ("--pp", "2", "--pp-schedule", "interleaved-1f1b")
RTOL, ATOL = 1e-4, 5e-5


_run = functools.partial(run_chargpt, job=JOB)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 4-block job on one process and, interleaved, on two ranks (uninterrupted)."""
    base = tmp_path_factory.mktemp("interleaved")
    return {"one": _run(base, "one", 1), "interleaved": _run(base, "interleaved", 2, *INTERLEAVED)}


def test_interleaved_two_ranks_train_the_same_model_as_one_process(runs):
    one, run = runs["one"], runs["interleaved"]
    reference = rank_losses(one)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1] - 0.5           # it learns something
    for rank in (0, 1):   # every rank logs the loss (the last stage's, broadcast)
        got = rank_losses(run, rank)
        assert sorted(got) == sorted(reference)
        torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                                   torch.tensor([reference[s] for s in sorted(reference)]),
                                   rtol=RTOL, atol=ATOL)
    ref_w, got_w = final_weights(one), final_weights(run)
    assert got_w.keys() == ref_w.keys()      # the .pt: the model's own names, not the chunks'
    for name, value in ref_w.items():
        torch.testing.assert_close(got_w[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    summary = summary_of(run)
    torch.testing.assert_close(summary["test_loss"], summary_of(one)["test_loss"], rtol=RTOL, atol=ATOL)
    assert summary["params_in_sync"] is True
    assert summary["global_batch"] == 8 and summary["strategy_effective"] == "pp"


def test_interleaved_killed_and_resumed_run_ends_with_the_uninterrupted_parameters(runs, tmp_path):
    """Rank 1 SIGKILLs itself at step 15; both resume from the step-10 DCP checkpoint (each
    rank's two chunks under stage-qualified keys) and end bitwise the uninterrupted run."""
    run = _run(tmp_path, "killed", 2, *INTERLEAVED, "--max-restarts", "1",
               env={"DISTTRAIN_FAULT": "kill:rank=1:step=15"})
    full = runs["interleaved"]
    got, want = final_weights(run), final_weights(full)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert summary_of(run)["params_sha256_per_rank"] == summary_of(full)["params_sha256_per_rank"]
    for rank in (0, 1):
        got_l = rank_losses(run, rank)
        assert set(range(11, STEPS + 1)) <= set(got_l)
        assert got_l == {step: v for step, v in rank_losses(full, rank).items() if step in got_l}
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(run / "checkpoints" / f"dcp-{STEPS:08d}")).read_metadata().state_dict_metadata
    for stage in range(4):
        assert any(k.startswith(f"model.stage{stage}.") for k in keys), stage


def test_interleaved_microbatches_not_a_multiple_of_pp_refused_before_start(tmp_path):
    res = run_cli(*JOB[:-2], "--batch-size", "6", "--microbatches", "3", "--nproc-per-node", "2",
                  *INTERLEAVED, "--run-dir", "refused", cwd=tmp_path, timeout=120)
    assert res.returncode == 2, (res.stdout + res.stderr)[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "microbatches" in ln]
    assert len(lines) == 1 and "not a multiple of pp 2" in lines[0], res.stderr[-2000:]
    assert not (tmp_path / "refused").exists()


def test_interleaved_on_too_few_blocks_is_refused_before_start(tmp_path):
    """Two stages per rank: --pp 2 needs 4 blocks; chargpt's default has 3. The CLI builds
    the model on meta and refuses before any process starts (plan/mesh_fit.py)."""
    res = run_cli("run", "--example", "chargpt", "--nproc-per-node", "2", *INTERLEAVED,
                  "--run-dir", "refused", cwd=tmp_path, timeout=120)
    assert res.returncode == 2, (res.stdout + res.stderr)[-2000:]
    assert res.stderr.strip().splitlines() == [
        "error: parallelism.pp_schedule: interleaved-1f1b cuts the model into 2 stages per "
        "rank, 4 for --pp 2, but it has 3 blocks; use --pp-schedule 1f1b (interleaved needs "
        "at least 4 blocks)"]
    assert not (tmp_path / "refused").exists()
