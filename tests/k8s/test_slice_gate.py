"""The memory plan's check of the HAMi slice in `k8s render` / `k8s apply` (issue 22):
`gpumem: auto` becomes the planned request (said in a comment), an explicit slice fits with
headroom or is refused with the flags that would fit (exit 2, one line, nothing applied),
a slice below one CUDA context is always refused, `--no-plan` skips it and says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_fake_apiserver import FakeApiServer
from tests.fixtures import copy_task

from conftest import validate_all

# 2 GPUs, one rank each: 512 context + 544 NCCL + 32 cuBLAS + the tensors -> 1280 MiB
JOB = ["--task", "slicetask:make_task", "--image", "registry.local/ml/train:1",
       "--image-has-disttrain", "--gpus", "2", "--nproc-per-node", "2", "--name", "plan"]
# width 8192: 64 M parameters, Adam: ~1 GiB of model state per rank under DDP
BIG = ["--task-args", "{width: 8192}"]


@pytest.fixture
def task_dir(workdir: Path) -> Path:
    copy_task("width_task", workdir, "slicetask")
    return workdir


def _gpumem(objects: list[dict[str, Any]]) -> set[str]:
    out = set()
    for obj in objects:
        if obj["kind"] == "Pod":
            for c in obj["spec"]["containers"]:
                out.add(c["resources"]["limits"].get("nvidia.com/gpumem"))
    return out


def test_auto_puts_the_planned_request_in_the_pod(cli: Any, task_dir: Path) -> None:
    r = cli("k8s", "render", *JOB, "--gpumem", "auto")
    assert r.code == 0, r.err
    comment = r.out.splitlines()[0]
    assert comment.startswith("# gpumem ") and "from the memory plan" in comment
    objects = [o for o in yaml.safe_load_all(r.out) if o]
    validate_all(objects)
    planned = comment.split()[2]
    assert _gpumem(objects) == {planned}
    assert int(planned) >= 512 + 544


def test_an_explicit_slice_that_fits_says_its_headroom(cli: Any, task_dir: Path) -> None:
    r = cli("k8s", "render", *JOB, "--gpumem", "4000")
    assert r.code == 0, r.err
    assert "note: fits: needs" in r.err and "MiB headroom" in r.err


def test_a_slice_below_one_context_is_refused_even_without_a_plan(cli: Any, workdir: Path) -> None:
    r = cli("k8s", "render", "train.py", "--image", "r/i:1", "--gpumem", "300", "--no-plan")
    assert r.code == 2 and r.out == ""
    assert len(r.error_lines) == 1 and "smaller than one CUDA context" in r.err


def test_no_plan_skips_with_the_reason(cli: Any, task_dir: Path) -> None:
    r = cli("k8s", "render", *JOB, *BIG, "--gpumem", "1500", "--no-plan")
    assert r.code == 0, r.err
    assert "memory plan skipped (--no-plan)" in r.err
    auto = cli("k8s", "render", *JOB, "--gpumem", "auto", "--no-plan")
    assert auto.code == 2 and "auto needs the memory plan" in auto.err


def test_a_too_small_slice_is_never_created(cli: Any, task_dir: Path,
                                            fake_api: FakeApiServer) -> None:
    r = cli("k8s", "apply", *JOB, *BIG, "--gpumem", "1500")
    assert r.code == 2, r.err
    assert len(r.error_lines) == 1, r.err
    line = r.error_lines[0]
    assert "per GPU" in line and "slice is 1500 MiB" in line and "--gpumem " in line
    assert fake_api.state.writes() == []
    assert not any(req.method == "POST" for req in fake_api.state.requests)
