"""The memory plan under tp and pp (issue 26 item 5): the degree is planned, not dropped;
pp plans every stage and reports the busiest; the search offers the smallest degree that
fits. No process is launched here (test_parallel_accuracy.py compares with real ranks)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disttrain.examples.chargpt import make_task
from disttrain.plan import fit
from disttrain.plan.slice import SliceOverhead
from disttrain.plan.trace import Knobs
from disttrain.plan.tracing import trace_memory

CHARGPT = ["--example", "chargpt", "--nproc-per-node", "2", "--gpus", "2", "--batch-size", "16"]
# no per-process constants: the slice is the tensors, so a degree can decide the verdict
BARE = SliceOverhead(context_mib=0, nccl_mib=0, cublas_mib=0, fragmentation=1.0, round_mib=1)


@pytest.fixture
def plan_json(capsys: pytest.CaptureFixture[str]) -> Any:
    from disttrain.cli.main import main

    def run(*argv: str) -> dict[str, Any]:
        code = main(["plan", *CHARGPT, *argv, "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out)

    return run


def test_plan_cli_plans_the_tp_and_pp_degrees_it_is_given(plan_json: Any) -> None:
    whole = trace_memory(make_task(), Knobs(world_size=2, local_world_size=2, batch_size=16))
    tp, pp = plan_json("--tp", "2"), plan_json("--pp", "2", "--pp-schedule", "gpipe")
    assert (tp["knobs"]["tp"], pp["knobs"]["pp"], pp["knobs"]["pp_schedule"]) == (2, 2, "gpipe")
    # the blocks' weights are split, the embeddings whole: less than all, more than half
    params = whole.largest["parameters"]
    assert 0.5 * params < tp["per_rank"]["parameters"] < 0.6 * params
    assert tp["peak_bytes"] < 0.7 * whole.peak_bytes
    stages = pp["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert pp["peak_bytes"] == max(s["peak_bytes"] for s in stages)   # the busiest rank
    # the stages hold disjoint blocks; the tied head is a copy on each end
    assert sum(s["parameters"] for s in stages) < 1.1 * whole.largest["parameters"]
    assert any("pp=2" in n for n in pp["notes"]) and any("tp=2" in n for n in tp["notes"])


def test_1f1b_holds_fewer_micro_batches_than_gpipe_on_the_first_stage() -> None:
    task = make_task()
    knobs = Knobs(world_size=2, local_world_size=2, batch_size=16, pp=2, microbatches=4)
    gpipe = trace_memory(task, knobs.replace(pp_schedule="gpipe")).stages
    one_f1b = trace_memory(task, knobs.replace(pp_schedule="1f1b")).stages
    # gpipe keeps all 4 micro-batches' activations, 1f1b at most pp=2 on stage 0 (measured
    # 0.53 with the receive buffers both keep); the last stage: 1 in flight against 4
    assert one_f1b[0]["activations"] < 0.6 * gpipe[0]["activations"]
    assert one_f1b[1]["activations"] < 0.35 * gpipe[1]["activations"]
    assert one_f1b[0]["parameters"] == gpipe[0]["parameters"]


def test_pp_refuses_what_the_run_refuses() -> None:
    from disttrain.errors import SpecError

    with pytest.raises(SpecError, match="grad_ckpt"):
        trace_memory(make_task(), Knobs(world_size=2, batch_size=16, pp=2, grad_ckpt=True))


def _search(task: Any, gpumem: int, monkeypatch: pytest.MonkeyPatch) -> fit.Suggestion:
    monkeypatch.setattr(fit, "KNOBS", ())   # the degree phase alone (the knobs have their tests)
    knobs = Knobs(world_size=2, local_world_size=2, batch_size=512)
    return fit.search_fit(task, knobs, gpumem, procs=1, overhead=BARE)


def test_search_offers_the_smallest_degree_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task()
    whole = trace_memory(task, Knobs(world_size=2, local_world_size=2, batch_size=512))
    need = whole.peak_bytes / 2**20
    s = _search(task, int(need * 0.8), monkeypatch)
    assert s.flags == ["--tp", "2"], s.tried
    assert s.gpumem_mib is not None and s.gpumem_mib <= need * 0.8


def test_search_skips_tp_when_it_does_not_divide_the_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task(heads=3)   # 96 / 3 heads: tp=2 cannot hold whole heads
    whole = trace_memory(task, Knobs(world_size=2, local_world_size=2, batch_size=512))
    s = _search(task, int(whole.peak_bytes / 2**20 * 0.8), monkeypatch)
    assert s.flags == ["--pp", "2"], s.tried
    assert all(f[:2] != ["--tp", "2"] for f, _ in s.tried)


def test_degree_options_stay_within_the_world_and_the_blocks() -> None:
    task = make_task(layers=2)
    knobs = Knobs(world_size=8, local_world_size=8, batch_size=16, strategy="fsdp")
    flags = [f for _, f in fit.degree_options(task, knobs)]
    degrees = {(f[0], int(f[1])) for f in flags}
    assert degrees == {("--tp", 2), ("--tp", 4), ("--pp", 2)}   # 4 heads, 2 blocks
    assert flags[0][:2] == ["--tp", "2"]                           # smallest first
    assert all("--strategy" in f for f in flags if f[0] == "--pp")  # fsdp x pp is not run


def test_a_split_job_is_offered_only_flags_the_run_takes() -> None:
    # tp over every rank: fsdp has no data-parallel rank (refused by the run), CPU offload
    # is not wired in; pp: no grad-ckpt
    tp = Knobs(world_size=2, local_world_size=2, batch_size=16, tp=2)
    offered = [f for _, f in fit.combinations(tp)]
    assert offered and not any("--strategy" in f or "--cpu-offload" in f for f in offered)
    pp = Knobs(world_size=2, local_world_size=2, batch_size=16, pp=2)
    assert not any("--grad-ckpt" in f for _, f in fit.combinations(pp))
    on_four = Knobs(world_size=4, local_world_size=4, batch_size=16, tp=2)   # fsdp x tp runs
    assert any(f == ["--strategy", "fsdp"] for _, f in fit.combinations(on_four))


def test_the_interleaved_schedule_is_refused_with_what_to_plan_instead() -> None:
    """A rank of interleaved 1F1B runs two stages under one schedule; the plan's fake world
    is one rank, so it is refused in one line naming the schedule that stands in for it."""
    from disttrain.errors import SpecError

    knobs = Knobs(world_size=2, local_world_size=2, batch_size=16, pp=2,
                  pp_schedule="interleaved-1f1b")
    with pytest.raises(SpecError, match="traces gpipe and 1f1b, not interleaved-1f1b yet; "
                                        "plan the job with --pp-schedule 1f1b"):
        trace_memory(make_task(layers=4), knobs)
