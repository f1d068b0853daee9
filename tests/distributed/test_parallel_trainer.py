"""Tensor and pipeline parallel through the product (issue 26): `disttrain run --example
chargpt --tp 2` and `--pp 2 --pp-schedule gpipe|1f1b` on two gloo ranks train the same
model as one process, and a run killed mid-way resumes to the same parameters.

Every run is the CLI in a subprocess, as a user runs it: a tiny chargpt (2 blocks of 4
heads, 16-character windows), 30 SGD steps of 8 windows, a checkpoint every
10 steps (the last one's .pt holds the consolidated weights, which is what is compared).
Tolerance against one process: rtol 1e-4, atol 5e-5 (fp32; the rowwise all-reduce and the
pipeline's micro-batches sum in another order than one process does, so values differ in
the last bits; measured: losses within 1.2e-6, parameters within 3.1e-6). Resumed against
uninterrupted runs of the same topology: bitwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import (
    CHARGPT_JOB,
    CHARGPT_STEPS,
    final_weights,
    rank_losses,
    run_chargpt,
    summary_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("no_stray_workers")]

STEPS = CHARGPT_STEPS
JOB = (*CHARGPT_JOB, "--batch-size", "8")
RTOL, ATOL = 1e-4, 5e-5
TOPOLOGIES = {"tp2": ("--tp", "2"), "pp2-gpipe": ("--pp", "2", "--pp-schedule", "gpipe"),
              "pp2-1f1b": ("--pp", "2", "--pp-schedule", "1f1b")}


_run = functools.partial(run_chargpt, job=JOB)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, chargpt_one_process: Path) -> dict[str, Path]:
    """One process (the session's, tests/distributed/conftest.py), and each topology on two
    ranks, uninterrupted."""
    base = tmp_path_factory.mktemp("parallel")
    out = {"one": chargpt_one_process}
    for name, flags in TOPOLOGIES.items():
        out[name] = _run(base, name, 2, *flags)
    return out


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_two_ranks_train_the_same_model_as_one_process(runs, topology):
    one, run = runs["one"], runs[topology]
    reference = rank_losses(one)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1] - 0.5           # it learns something
    for rank in (0, 1):   # every rank logs the loss (pp: the last stage's, broadcast)
        got = rank_losses(run, rank)
        assert sorted(got) == sorted(reference)
        torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                                   torch.tensor([reference[s] for s in sorted(reference)]),
                                   rtol=RTOL, atol=ATOL)
    ref_w, got_w = final_weights(one), final_weights(run)
    assert got_w.keys() == ref_w.keys()
    for name, value in ref_w.items():
        torch.testing.assert_close(got_w[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    summary = summary_of(run)
    torch.testing.assert_close(summary["test_loss"], summary_of(one)["test_loss"], rtol=RTOL, atol=ATOL)
    assert summary["params_in_sync"] is True
    assert summary["global_batch"] == 8 and summary["lr_effective"] == 0.5  # one data slice
    assert summary["strategy_effective"] == topology[:2]


@pytest.mark.parametrize(("topology", "fault"), [
    ("tp2", "kill:rank=0:step=15"),
    ("pp2-1f1b", "kill:rank=1:step=15"),
])
def test_killed_and_resumed_run_ends_with_the_uninterrupted_parameters(runs, tmp_path, topology, fault):
    """A rank SIGKILLs itself at step 15; torchrun restarts both, they resume from the
    step-10 checkpoint (torch.distributed.checkpoint, per rank) and finish: bitwise the
    uninterrupted run of the same topology."""
    run = _run(tmp_path, "killed", 2, *TOPOLOGIES[topology], "--max-restarts", "1",
               env={"DISTTRAIN_FAULT": fault})
    full = runs[topology]
    got, want = final_weights(run), final_weights(full)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert summary_of(run)["params_sha256_per_rank"] == summary_of(full)["params_sha256_per_rank"]
    for rank in (0, 1):   # the steps after the resume (the first round's buffered
        got = rank_losses(run, rank)   # records may die with it), bitwise the uninterrupted run's
        assert set(range(11, STEPS + 1)) <= set(got)
        assert got == {step: v for step, v in rank_losses(full, rank).items() if step in got}
    assert list((run / "checkpoints").glob("dcp-*")), "the checkpoints are not DCP folders"
