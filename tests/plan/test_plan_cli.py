"""`disttrain plan`: the --json object other tools read, the verdict and its exit code, the
flags that would make a job fit, and the slice arithmetic with its named constants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disttrain.plan.fit import combinations
from disttrain.plan.slice import (
    CUDA_CONTEXT_MIB,
    MIN_SLICE_MIB,
    NCCL_2GPU_MIB,
    SliceOverhead,
    procs_per_gpu,
    slice_request,
    too_small,
)
from disttrain.plan.trace import Knobs
from tests.fixtures import copy_task

JOB = ["--task", "plantask:make_task", "--gpus", "2", "--nproc-per-node", "2"]
BIG = ["--task-args", "{width: 8192}"]   # ~1.3 GiB of tensors per rank under DDP + Adam


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    from disttrain.cli.main import main

    monkeypatch.chdir(tmp_path)
    copy_task("width_task", tmp_path, "plantask")   # the one source the slice gate's tests share

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_json_has_the_fields_other_tools_read(cli: Any) -> None:
    code, out, _ = cli("plan", *JOB, "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] is None   # no slice set
    assert plan["peak_bytes"] > 0
    assert plan["gpumem_mib"] >= CUDA_CONTEXT_MIB + NCCL_2GPU_MIB
    assert set(plan["per_rank"]) == {"parameters", "gradients", "optimizer", "activations",
                                     "temporaries"}
    assert plan["knobs"]["world_size"] == 2 and plan["knobs"]["strategy"] == "ddp"
    fits = json.loads(cli("plan", *JOB, "--json", "--gpumem", "8000")[1])
    assert fits["fits"] is True and fits["headroom_mib"] == 8000 - fits["gpumem_mib"]


def test_a_job_over_its_slice_gets_the_flags_that_fit(cli: Any) -> None:
    code, out, _ = cli("plan", *JOB, *BIG, "--gpumem", "2600", "--json")
    assert code == 1
    plan = json.loads(out)
    assert plan["fits"] is False and plan["gpumem_mib"] > 2600
    suggestion = plan["suggestion"]
    assert suggestion["flags"] == ["--strategy", "fsdp"] and suggestion["gpumem_mib"] <= 2600
    code, out, _ = cli("plan", *JOB, *BIG, "--gpumem", "2600")
    assert code == 1 and "pass --strategy fsdp (" in out and f"--gpumem {plan['gpumem_mib']}" in out


def test_the_table_names_every_category_and_the_peak_phase(cli: Any) -> None:
    code, out, _ = cli("plan", *JOB)
    assert code == 0
    for word in ("parameters", "gradients", "optimizer", "activations", "temporaries",
                 "tensor peak", "in step ", "gpumem", "CUDA context"):
        assert word in out, word


def test_bad_input_is_one_line_exit_2(cli: Any) -> None:
    code, _, err = cli("plan", "--task", "nosuchmodule:make_task")
    assert code == 2 and err.count("error:") == 1
    code, _, err = cli("plan", *JOB, "--gpumem", "100")
    assert code == 2 and "smaller than one CUDA context" in err


def test_slice_request_adds_each_named_term() -> None:
    one = slice_request(1000 * 2**20, procs_per_gpu=1, world_size=1)
    assert one.nccl_mib == 0 and one.context_mib == CUDA_CONTEXT_MIB
    assert one.gpumem_mib % 256 == 0 and one.gpumem_mib >= 1000 * 1.2 + CUDA_CONTEXT_MIB + 32
    two = slice_request(1000 * 2**20, procs_per_gpu=2, world_size=2)
    assert two.context_mib == 2 * CUDA_CONTEXT_MIB and two.nccl_mib == 2 * NCCL_2GPU_MIB
    mine = slice_request(0, 1, 4, SliceOverhead(context_mib=300, nccl_mib=100, cublas_mib=0,
                                                 round_mib=1))
    assert mine.gpumem_mib == 400
    assert procs_per_gpu(4, 2) == 2 and procs_per_gpu(1, 4) == 1
    assert too_small(MIN_SLICE_MIB - 1) and too_small(MIN_SLICE_MIB) is None


def test_knob_combinations_come_cheapest_first() -> None:
    combos = [flags for _, flags in combinations(Knobs(strategy="ddp", world_size=2,
                                                       batch_size=32))]
    assert combos[0] == ["--precision", "bf16"]
    assert combos[1] == ["--strategy", "fsdp"]
    assert ["--batch-size", "16", "--grad-accum", "2"] in combos
    assert combos[-1][-2:] == ["--optimizer", "sgd"]
    # a one-rank job has no FSDP to turn to
    assert not any("fsdp" in f for f in
                   (f for _, fl in combinations(Knobs(strategy="none", world_size=1)) for f in fl))


def test_host_memory_and_shm_are_checked_against_the_pod(cli: Any) -> None:
    code, out, _ = cli("plan", *JOB, "--json", "--memory", "{limit: 512Mi}",
                       "--num-workers", "2", "--shm", "1Mi")
    assert code == 0
    host = json.loads(out)["host"]
    assert host["memory_limit_mib"] == 512 and host["memory_fits"] is False
    assert host["shm_mib"] > 1 and host["shm_fits"] is False
    text = cli("plan", *JOB, "--memory", "{limit: 512Mi}")[1]
    assert "DOES NOT FIT" in text
