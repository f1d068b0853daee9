"""Data parallel on top of tensor / pipeline parallel through the product (issue 26 item 4):
`disttrain run --example chargpt --nproc-per-node 4` with `--pp 2` (pp=2 x dp=2, ddp),
`--strategy fsdp --tp 2` (dp_shard=2 x tp=2, FSDP2 x TP) and `--tp 2` (dp=2 x tp=2, ddp)
train the same model as one process on the same global batch (8 windows: 4 per data
slice), killed FSDP2 x TP and pp x dp runs resume to the uninterrupted ones bitwise, and
tp x pp is refused before anything starts.

Every run is the CLI in a process of its own (`start_cli`): a tiny chargpt (2 blocks of 4
heads, 16-character windows), 30 SGD steps, a checkpoint every 10 (the step-30 .pt holds
the consolidated weights: full tensors gathered from the shards, where the fused qkv rows
must be in the model's order). The one-process run is the session's (tests/distributed/conftest.py, shared
with test_parallel_trainer.py). The five runs go one after another: five at once (20 ranks
on 2 cores) cost more CPU for the same work and took no less time (this file alone: 102
CPU-s in 57 s five at once, 84 CPU-s in 56 s one after another).
Tolerance against one process: rtol 1e-4, atol 5e-5 (fp32; the data-parallel average and
tp's all-reduces sum in another order; measured over the 30 steps: losses within 1.9e-6,
parameters within 3.9e-6). The logged loss of a step is each data slice's own mean; their mean over the ranks
(every slice is held by equally many ranks) is the one-process loss of the whole batch.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import run_cli, start_cli
from tests.distributed.conftest import CHARGPT_JOB, CHARGPT_STEPS, final_weights, summary_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = CHARGPT_STEPS
JOB = CHARGPT_JOB
# 4 ranks, 2 data slices of 4 windows: the global batch of one process's 8, the same lr
SPLIT = ("--nproc-per-node", "4", "--batch-size", "4", "--lr-scaling", "none")
RTOL, ATOL = 1e-4, 5e-5
RUNS: dict[str, tuple[str, ...]] = {
    "ddp+pp": (*SPLIT, "--pp", "2", "--microbatches", "2"),
    "fsdp+tp": (*SPLIT, "--strategy", "fsdp", "--tp", "2"),
    "ddp+tp": (*SPLIT, "--tp", "2"),
    "fsdp+tp killed": (*SPLIT, "--strategy", "fsdp", "--tp", "2", "--max-restarts", "1"),
    "ddp+pp killed": (*SPLIT, "--pp", "2", "--microbatches", "2", "--max-restarts", "1"),
}
# after the step-10 checkpoint: they resume from it (rank 2 is a last-stage rank under pp)
FAULTS = {"fsdp+tp killed": "kill:rank=1:step=15", "ddp+pp killed": "kill:rank=2:step=15"}


def _slug(name: str) -> str:
    return name.replace(" ", "-").replace("+", "-")


def _start(base: Path, name: str, flags: tuple[str, ...]) -> Any:
    """`disttrain run` of one of RUNS into base/<slug>, its output into base/<slug>.log."""
    env = {"DISTTRAIN_FAULT": FAULTS[name]} if name in FAULTS else None
    return start_cli(*JOB, *flags, "--run-dir", _slug(name), cwd=base,
                     log=base / f"{_slug(name)}.log", env=env, start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    """Every run of RUNS, one after another, and the session's one-process run ("one");
    {name: run dir}. The session's run is asked for once the first has started: another
    pytest-xdist worker may be making it, and this file's runs need not wait for it."""
    base = tmp_path_factory.mktemp("composed")
    procs: dict[str, Any] = {}
    one: Path | None = None
    try:
        for name, flags in RUNS.items():
            procs[name] = _start(base, name, flags)
            if one is None:
                one = request.getfixturevalue("chargpt_one_process")
            procs[name].wait(timeout=420)
    finally:
        for proc in procs.values():   # only what this fixture started, on a timeout or error
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outs = {name: (base / f"{_slug(name)}.log").read_text() for name in procs}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outs[name][-4000:]}"
        assert "leaked semaphore" not in outs[name], f"{name}:\n{outs[name][-4000:]}"
    for name in FAULTS:
        killed = outs[name]
        assert "disttrain fault injection" in killed, f"{name}: the fault never fired"
        assert "resumed from" in killed and "ckpt-00000010" in killed, killed[-4000:]
    assert one is not None
    return {"one": one,
            **{name: base / _slug(name) for name in RUNS}}


def _losses(run: Path) -> dict[int, dict[int, float]]:
    """{step: {rank: loss}} of the train rows."""
    out: dict[int, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            out.setdefault(row["step"], {})[row["rank"]] = row["loss"]
    return out


@pytest.mark.parametrize("name", ["ddp+pp", "fsdp+tp", "ddp+tp"])
def test_four_ranks_train_the_same_model_as_one_process(runs, name):
    one, run = runs["one"], runs[name]
    reference, got = _losses(one), _losses(run)
    assert sorted(reference) == list(range(1, STEPS + 1)) == sorted(got)
    assert reference[STEPS][0] < reference[1][0] - 0.3            # it learns something
    assert all(sorted(got[s]) == [0, 1, 2, 3] for s in got)        # every rank logs
    slices = {got[1][r] for r in range(4)}
    assert len(slices) == 2, "the two data slices read different windows"
    torch.testing.assert_close(
        torch.tensor([sum(got[s].values()) / 4 for s in sorted(got)]),
        torch.tensor([reference[s][0] for s in sorted(reference)]), rtol=RTOL, atol=ATOL)
    ref_w, got_w = final_weights(one), final_weights(run)
    assert got_w.keys() == ref_w.keys()
    for key, value in ref_w.items():   # full tensors: the fused qkv rows in the model's order
        torch.testing.assert_close(got_w[key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"{key}: {m}")
    summary = summary_of(run)
    torch.testing.assert_close(summary["test_loss"], summary_of(one)["test_loss"], rtol=RTOL, atol=ATOL)
    assert summary["strategy_effective"] == name
    assert summary["global_batch"] == 8 and summary["lr_effective"] == 0.5
    # the end-of-run check compared the data-parallel replicas' copies and found them equal
    assert summary["params_in_sync"] is True
    assert "held by several ranks compared" in summary["params_check"]
    if name.startswith("ddp"):   # every stage / tp shard has a dp replica to be compared with
        assert "held by one rank only" not in summary["params_check"], summary["params_check"]
    # the gradient bytes a rank reduces per step are its piece's, counted after the split:
    # a tp half (replicated norms whole) or a pipeline stage, never the whole model (what
    # FSDP x TP reported before) nor nothing (what DDP x TP / PP reported)
    whole = _model_bytes()
    sent = summary["allreduce_bytes_per_step"]
    low = whole // 2 if name.endswith("tp") else 1
    assert low <= sent < whole, (sent, whole)


def test_fsdp_tp_reduces_in_bf16_with_comm_hook_bf16(runs, tmp_path):
    """--comm-hook bf16 under FSDP2 x TP: FSDP reduces the gradients in bf16 (its
    MixedPrecisionPolicy), as under plain FSDP, instead of a note that the flag was ignored."""
    res = run_cli(*JOB[:JOB.index("--max-steps") + 1], "3", *JOB[JOB.index("--max-steps") + 2:],
                  *RUNS["fsdp+tp"], "--comm-hook", "bf16", "--run-dir", "bf16", cwd=tmp_path,
                  timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = summary_of(tmp_path / "bf16")
    assert summary["comm_hook"] == "bf16" and summary["strategy_effective"] == "fsdp+tp"
    assert not any("ignored" in note for note in summary["notes"]), summary["notes"]
    fp32 = summary_of(runs["fsdp+tp"])["allreduce_bytes_per_step"]
    # FSDP's bytes halve; the fused biases it leaves out are averaged in fp32 by hand
    assert fp32 / 2 <= summary["allreduce_bytes_per_step"] < 0.6 * fp32, (summary, fp32)


def _model_bytes() -> int:
    """The bytes of the job's chargpt's parameters, built whole on this process."""
    from disttrain.examples.chargpt import make_task

    args = json.loads(JOB[JOB.index("--task-args") + 1])
    model = make_task(**args).model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", ["fsdp+tp", "ddp+pp"])
def test_killed_run_resumes_to_the_uninterrupted_parameters(runs, name):
    """A rank SIGKILLs itself at step 15; torchrun restarts the four, they resume from the
    step-10 DCP checkpoint (fsdp+tp: 2-D DTensors, FSDP2 shards of tp shards; ddp+pp: each
    stage's part, written once for its two replicas) and end bitwise equal to the
    uninterrupted run of the same topology."""
    run, full = runs[f"{name} killed"], runs[name]
    got, want = final_weights(run), final_weights(full)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert summary_of(run)["params_sha256_per_rank"] == summary_of(full)["params_sha256_per_rank"]
    resumed, uninterrupted = _losses(run), _losses(full)
    assert set(range(11, STEPS + 1)) <= set(resumed)
    assert all(resumed[s] == uninterrupted[s] for s in range(11, STEPS + 1))
    assert list((run / "checkpoints").glob("dcp-*")), "the checkpoints are not DCP folders"


def test_tp_with_pp_is_refused_before_anything_starts(tmp_path):
    res = run_cli(*JOB, "--nproc-per-node", "4", "--tp", "2", "--pp", "2", "--run-dir", "r",
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "tp and pp together are not supported yet" in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("overrides, kind", [
    ({"pp": 2}, "pp"), ({"tp": 2, "strategy": "fsdp"}, "tp"), ({"tp": 2}, "tp"),
])
def test_composed_degrees_are_accepted_with_the_rest_as_data_parallel(overrides, kind):
    from disttrain.spec.job import JobSpec
    from disttrain.spec.parallelism import resolve_degrees

    spec = JobSpec.from_dict({"example": "chargpt"}, {"nproc_per_node": 4, **overrides})
    degrees = resolve_degrees(spec.parallelism, 4)
    assert (degrees.dp_shard, getattr(degrees, kind)) == (2, 2)


# -- the fused q|k|v under FSDP2 x TP, at the library level (one spawn of 4 ranks) -----------
class Conv1D(nn.Module):
    """transformers' Conv1D as `tp_plans.is_conv1d` recognises it (weight (nx, nf))."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))


class Projections(nn.Module):
    """A fused q|k|v Linear, a GPT2-style fused Conv1D and a plain colwise Linear (FSDP2
    wraps modules with a forward only; this one is never run)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.c_attn, self.fc = nn.Linear(8, 24), Conv1D(24, 8), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _fused_under_fsdp_tp(folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from disttrain.distributed.composed import fully_shard_tp
    from disttrain.distributed.mesh import build_mesh
    from disttrain.distributed.sync_check import check_copies_in_sync, dtensor_copies
    from disttrain.distributed.tensor_parallel import dcp_view, full_state_dict
    from disttrain.distributed.tp_plans import Conv1DColwiseParallel, FusedColwiseParallel
    from disttrain.spec.parallelism import ParallelismSpec, resolve_degrees
    from disttrain.testing import setup_for_test

    rt = setup_for_test()
    try:
        torch.manual_seed(0)
        model = Projections()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        mesh = build_mesh(resolve_degrees(ParallelismSpec(tp=2), rt.world_size), rt)  # dp_shard=2
        parallelize_module(model, mesh["tp"], {"qkv": FusedColwiseParallel(),
                                               "c_attn": Conv1DColwiseParallel(parts=3),
                                               "fc": ColwiseParallel()})
        kept = fully_shard_tp(model, mesh["dp_shard"], None, gloo=True)
        out: dict[str, Any] = {"kept": sorted(n for n, p in model.named_parameters()
                                              if any(p is k for k in kept))}
        out["full"] = {k: torch.equal(v, want[k]) for k, v in full_state_dict(model).items()}
        state = {"model": get_model_state_dict(model)}
        dcp.save(dcp_view(state), checkpoint_id=folder)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
        dcp.load(dcp_view(state), checkpoint_id=folder)   # in place, through the views
        out["reloaded"] = {k: torch.equal(v, want[k]) for k, v in full_state_dict(model).items()}
        with torch.no_grad():   # dp rank 1's copy of a fused bias drifts: the check names it
            if mesh.get_local_rank("dp_shard") == 1:
                model.qkv.bias.to_local().add_(1.0)
        report = check_copies_in_sync(dtensor_copies(model))
        out["drift"] = (report.in_sync, report.first_diverged, report.diverged_ranks)
        return out
    finally:
        rt.shutdown()


@pytest.mark.timeout(300)
def test_fused_qkv_under_fsdp_tp_gathers_saves_and_checks_in_the_models_row_order(tmp_path):
    """FSDP2 over tp-strided q|k|v weights (a Linear's and a GPT2 Conv1D's): the full
    tensors gathered from the 2-D shards are the original ones (FSDP's default dim-0 chunk
    gave them in the wrong order, with zeros), a DCP save / load round trip restores them,
    and the fused biases FSDP leaves alone are compared across the dp replicas."""
    from disttrain.testing import run_ranks

    results = run_ranks(4, _fused_under_fsdp_tp, str(tmp_path / "dcp"), timeout_s=120)
    for rank, r in results.items():
        assert r["kept"] == ["c_attn.bias", "qkv.bias"], rank
        assert r["full"] and all(r["full"].values()), (rank, r["full"])
        assert all(r["reloaded"].values()), (rank, r["reloaded"])
        in_sync, first, ranks = r["drift"]
        # ranks 2 and 3 are dp rank 1 of tp shards 0 and 1: each differs from its dp replica
        assert not in_sync and first.startswith("qkv.bias@tp=") and ranks == [2, 3], r["drift"]
