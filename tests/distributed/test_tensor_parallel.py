"""Tensor and pipeline parallel (issue 26): the parallelism degrees, the mesh, the plans and
cuts, a Hugging Face Llama under tp=2 against one process, and the sync check on DTensor
shards.

chargpt under tp=2 and pp=2 (gpipe, 1f1b) against one process, and killed-and-resumed, is
proved through the product (`disttrain run`, the Trainer) in
tests/distributed/test_parallel_trainer.py; GPT2's plan in tests/distributed/test_tp_gpt2.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from disttrain.distributed.tensor_parallel import check_heads, heads_of, tp_plan_for
from disttrain.errors import SpecError, StrategyError
from disttrain.spec.job import JobSpec
from disttrain.spec.parallelism import Degrees, ParallelismSpec, resolve_degrees
from disttrain.testing import run_ranks, setup_for_test

TASK = "disttrain.examples.chargpt:make_task"
SEED = 5
# fp32 against one process: the rowwise all-reduce adds two partial sums where one process
# adds one long sum, so values differ in the last bits.
RTOL, ATOL = 1e-4, 5e-5


# -- degrees ---------------------------------------------------------------------------------
def test_degrees_fill_the_rest_and_default_to_plain_data_parallel():
    assert resolve_degrees(ParallelismSpec(), 4) == Degrees(pp=1, dp_replicate=1, dp_shard=4, tp=1)
    assert resolve_degrees(ParallelismSpec(tp=2), 4).dp_shard == 2
    assert resolve_degrees(ParallelismSpec(tp=-1), 4) == Degrees(1, 1, 1, 4)
    # the ranks get a full dump (defaults included): it must mean the same
    dumped = ParallelismSpec.model_validate(ParallelismSpec(tp=-1, pp_schedule="1f1b").model_dump())
    assert resolve_degrees(dumped, 4) == Degrees(1, 1, 1, 4)


@pytest.mark.parametrize("given, world, words", [
    ({"tp": 3}, 2, "tp=3"),
    ({"tp": 2, "dp_shard": 2}, 2, "multiply to 4 but the world size is 2"),
])
def test_degrees_that_do_not_fit_the_world_are_refused_naming_them(given, world, words):
    with pytest.raises(SpecError, match=words) as err:
        resolve_degrees(ParallelismSpec(**given), world)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    ({"tp": 3, "nproc_per_node": 2}, "tp=3"),
    ({"tp": -1, "pp": -1, "nproc_per_node": 2}, "only one degree may be -1"),
    ({"tp": 0}, "at least 1"),
    ({"pp_schedule": "gpipe"}, "pp_schedule: applies to pipeline parallel only"),
    ({"tp": 2, "pp": 2, "nproc_per_node": 4}, "tp and pp together"),
    ({"pp": 2, "nproc_per_node": 4, "strategy": "fsdp"}, "fsdp with pp is not supported yet"),
    ({"tp": 2, "dp_replicate": 2, "nproc_per_node": 4}, "a dp_replicate degree is not supported"),
    ({"tp": 2, "nproc_per_node": 2, "strategy": "fsdp"}, "strategy fsdp splits the data"),
    ({"pp": 2, "nproc_per_node": 2, "batch_size": 6}, "microbatches: 4 does not divide"),
])
def test_spec_refuses_bad_degrees_before_launch(overrides, words):
    with pytest.raises(SpecError, match=words) as err:
        JobSpec.from_dict({"task": TASK}, overrides)
    assert str(err.value).count("\n") == 0
    assert "parallelism" in str(err.value)


@pytest.mark.parametrize("overrides", [{"tp": 2}, {"pp": 2}, {"tp": -1}, {"pp": 2, "pp_schedule": "gpipe"}])
def test_tp_or_pp_alone_over_every_rank_is_accepted(overrides):
    spec = JobSpec.from_dict({"task": TASK}, {"nproc_per_node": 2, **overrides})
    assert spec.parallelism.model_parallel


def test_a_script_job_refuses_the_parallelism_section():
    with pytest.raises(SpecError, match="a script builds its own"):
        JobSpec.from_dict({"script": "train.py", "parallelism": {"tp": 2}})


# -- plans and head counts -------------------------------------------------------------------
def _tiny_model() -> nn.Module:
    from disttrain.examples.chargpt import CharGPT

    return CharGPT(20, block=8, layers=2, width=24, heads=6)


def test_heads_are_found_and_a_tp_that_does_not_divide_them_is_refused():
    model = _tiny_model()
    assert set(heads_of(model).values()) == {6}
    check_heads(model, 3)
    with pytest.raises(StrategyError, match=r"parallelism\.tp: 4 does not divide the model's 6 heads"):
        check_heads(model, 4)


def test_a_model_without_a_known_plan_is_refused_naming_tp_plan():
    assert callable(tp_plan_for(_tiny_model()))
    with pytest.raises(StrategyError, match="tp_plan"):
        tp_plan_for(nn.Sequential(nn.Linear(4, 4)))
    own = {"0": object()}
    assert tp_plan_for(nn.Sequential(nn.Linear(4, 4)), own) is own  # type: ignore[arg-type]


# -- a Hugging Face Llama decoder (built from a config: nothing downloaded) ------------------
def _train_llama(tp: int) -> dict[str, Any]:
    """10 SGD steps of a 2-layer Llama, tensor parallel by the built-in plan when tp > 1."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    from disttrain.distributed.tensor_parallel import apply_tp, full_state_dict

    rt = setup_for_test() if tp > 1 else SimpleNamespace(world_size=1)
    try:
        torch.manual_seed(SEED)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        if tp > 1:
            from disttrain.distributed.mesh import build_mesh

            mesh = build_mesh(resolve_degrees(ParallelismSpec(tp=tp), rt.world_size), rt)
            check_heads(model, tp)
            apply_tp(model, mesh["tp"], tp_plan_for(model))
        from disttrain.train.optim import build_optimizer

        opt = build_optimizer("sgd", model.parameters(), 0.1)
        gen = torch.Generator().manual_seed(SEED)
        losses = []
        for _ in range(10):
            ids = torch.randint(0, 64, (4, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "params": full_state_dict(model)}
    finally:
        if tp > 1:
            rt.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hf_llama_tp2_matches_one_process():
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    reference = _train_llama(1)
    results = run_ranks(2, _train_llama, 2, timeout_s=180)
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(results[rank]["losses"]),
                                   torch.tensor(reference["losses"]), rtol=RTOL, atol=ATOL)
        for name, ref in reference["params"].items():
            torch.testing.assert_close(results[rank]["params"][name], ref, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name: f"{name}: {m}")


# -- pipeline parallel -----------------------------------------------------------------------
def test_cuts_balance_parameters_and_too_many_stages_are_refused():
    from disttrain.distributed.pipeline import balanced_cuts
    from disttrain.examples.chargpt import Block, CharGPT

    model = CharGPT(20, block=8, layers=4, width=24, heads=6)
    assert balanced_cuts(model, Block, 2) == ["blocks.2"]
    assert balanced_cuts(model, Block, 4) == ["blocks.1", "blocks.2", "blocks.3"]
    with pytest.raises(StrategyError, match=r"parallelism\.pp: 5 stages but the model has 4 blocks"):
        balanced_cuts(model, Block, 5)
    with pytest.raises(StrategyError, match="fsdp_block"):
        balanced_cuts(model, None, 2)


# -- the sync check on DTensor shards ---------------------------------------------------------
def _tp_sync_reports() -> dict[str, Any]:
    """tp=2 chargpt: in sync, then one replicated weight (the embedding) changed on rank 1,
    then only rank 1's own shard of a split weight changed."""
    from disttrain.distributed.mesh import build_mesh
    from disttrain.distributed.sync_check import check_copies_in_sync, dtensor_copies
    from disttrain.distributed.tensor_parallel import apply_tp

    rt = setup_for_test()
    try:
        model = _tiny_model()
        mesh = build_mesh(resolve_degrees(ParallelismSpec(tp=2), rt.world_size), rt)
        apply_tp(model, mesh["tp"], tp_plan_for(model))
        out = {"clean": check_copies_in_sync(dtensor_copies(model))}
        keys = [k for k, _ in dtensor_copies(model)]
        with torch.no_grad():
            if rt.rank == 1:
                model.blocks[0].mlp[0].weight.to_local().add_(1.0)   # its own shard only
        out["shard"] = check_copies_in_sync(dtensor_copies(model))
        with torch.no_grad():
            if rt.rank == 1:
                model.pos.weight.add_(1.0)                            # replicated on both
        out["replicated"] = check_copies_in_sync(dtensor_copies(model))
        return {"keys": keys, **{k: (r.in_sync, r.first_diverged, r.diverged_ranks, r.describe())
                                 for k, r in out.items()}}
    finally:
        rt.shutdown()


@pytest.mark.timeout(120)
def test_sync_check_compares_replicated_tensors_and_counts_lone_shards():
    results = run_ranks(2, _tp_sync_reports, timeout_s=90)
    r = results[0]
    assert "blocks.0.mlp.0.weight@tp=0" in r["keys"] and "pos.weight" in r["keys"]
    assert r["clean"][0] and "held by one rank only" in r["clean"][3]
    # with dp=1 every tp shard is held by one rank: nothing to compare it with, no failure
    assert r["shard"][0]
    assert r["replicated"][:3] == (False, "pos.weight", [1])
    assert results[1]["replicated"][:3] == r["replicated"][:3]


def test_pipeline_loaders_yield_whole_batches_only():
    """pp traces its stages for batch_size / microbatches rows: an epoch's short last batch
    is dropped, by both loaders alike, and a resume mid-epoch still ends there."""
    from torch.utils.data import TensorDataset

    from disttrain.train.loader import DatasetLoader, ShardedLoader

    x, y = torch.arange(21).float().unsqueeze(1), torch.arange(21)
    for loader in (ShardedLoader(x, y, 4, 0, 1, seed=1),
                   DatasetLoader(TensorDataset(x, y), 4, 0, 1, seed=1)):
        assert len(loader) == 6 and [len(b[0]) for b in loader][-1] == 1
        loader.whole_batches = True
        assert len(loader) == 5 and [len(b[0]) for b in loader] == [4] * 5
        loader.skip = 3
        assert [len(b[0]) for b in loader] == [4, 4]


def test_a_job_file_parallelism_section_means_what_the_flags_mean(tmp_path):
    """`disttrain run -f job.yaml` with a `parallelism:` section (the yaml read as the CLI
    reads it) resolves to the same degrees as `--pp 2 --pp-schedule gpipe`."""
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text("task: disttrain.examples.chargpt:make_task\nlaunch: {nproc_per_node: 2}\n"
                    "parallelism: {pp: 2, pp_schedule: gpipe, microbatches: 2}\n")
    from_file = JobSpec.from_dict(yaml.safe_load(path.read_text()))
    from_flags = JobSpec.from_dict({"task": TASK}, {"nproc_per_node": 2, "pp": 2,
                                                    "pp_schedule": "gpipe", "microbatches": 2})
    assert from_file.parallelism == from_flags.parallelism
    assert resolve_degrees(from_file.parallelism, 2) == Degrees(pp=2, dp_replicate=1, dp_shard=1, tp=1)
    # the ranks get the spec's full dump: it must mean the same
    assert JobSpec.from_dict(yaml.safe_load(from_file.to_yaml())).parallelism == from_file.parallelism
