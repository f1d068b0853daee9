"""Parallelism degrees refused before anything starts (issue 26 must-show): a degree product
that does not match the world size, a tp that does not divide the model's heads, a pp larger
than its number of blocks. Each is exit 2 with one `error:` line naming the degree and the
fix, no traceback, no run dir, no rank started; through `disttrain run` (a subprocess, as a
user runs it), `disttrain plan` and `disttrain k8s render` (in-process).

The model checks build the task's model on the meta device in the CLI
(`disttrain.plan.mesh_fit`): chargpt with `layers: 3` has 3 blocks of 4 heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disttrain.errors import SpecError, StrategyError
from disttrain.plan.mesh_fit import builds_model, check_mesh_fits, degrees_before_launch
from disttrain.spec.job import JobSpec
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(300)

CHARGPT = ("--example", "chargpt", "--task-args", "{layers: 3}")
REFUSED = {
    "product": (("--tp", "4", "--nproc-per-node", "2"),
                "parallelism: pp=1, dp_replicate=1, dp_shard=-1, tp=4: the fixed degrees multiply "
                "to 4, which does not divide the world size 2"),
    "product-auto": (("--dp-shard", "3"),   # nproc auto = 2 on a machine without GPUs
                     "parallelism: pp=1, dp_replicate=1, dp_shard=3, tp=1: the degrees multiply to "
                     "3 but the world size is 2"),
    "heads": (("--tp", "3", "--nproc-per-node", "3"),
              "parallelism.tp: 3 does not divide the model's 4 heads"),
    "heads-rest": (("--tp", "-1", "--nproc-per-node", "3"),   # -1 = every rank = 3
                   "parallelism.tp: 3 does not divide the model's 4 heads"),
    "hook-ddp": (("--tp", "2", "--nproc-per-node", "4", "--comm-hook", "bf16"),
                 "train.comm_hook: bf16 with tp / pp does not apply"),
    "hook-fsdp-powersgd": (("--tp", "2", "--nproc-per-node", "4", "--strategy", "fsdp",
                            "--comm-hook", "powersgd"), "train.comm_hook: powersgd"),
    "blocks": (("--pp", "4", "--nproc-per-node", "4"),
               "parallelism.pp: 4 stages but the model has 3 blocks (CharGPT); use --pp 3 or fewer"),
}


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_run_refuses_degrees_before_any_process_starts(tmp_path: Path, case: str) -> None:
    args, words = REFUSED[case]
    run_dir = tmp_path / "runs" / "tp"
    res = run_cli("run", *CHARGPT, *args, "--run-dir", str(run_dir), cwd=tmp_path, timeout=120,
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    errors = _error_lines(res.stderr)
    assert len(errors) == 1 and words in errors[0], res.stderr
    assert "Local ranks" not in res.stderr + res.stdout and "rank 0" not in res.stdout
    assert not run_dir.exists()   # nothing written: the checks ran before the run dir


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from disttrain.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("case", ["heads", "blocks", "product"])
def test_plan_refuses_the_same_degrees(capsys: pytest.CaptureFixture[str], case: str) -> None:
    args, words = REFUSED[case]
    code, out, err = _main(capsys, "plan", *CHARGPT, *args)
    assert code == 2, err
    errors = _error_lines(err)
    assert len(errors) == 1 and words in errors[0], err
    assert out == ""


K8S = ("k8s", "render", *CHARGPT, "--image", "registry.local/ml/train:1", "--image-has-disttrain",
       "--gpus", "4")


@pytest.mark.parametrize("case", ["heads", "blocks"])
def test_k8s_render_refuses_the_model_checks(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.chdir(tmp_path)
    args, words = REFUSED[case]
    code, out, err = _main(capsys, *K8S, *args)
    assert code == 2, err
    errors = _error_lines(err)
    assert len(errors) == 1 and words in errors[0], err
    assert out == ""   # nothing rendered


def _spec(**overrides: Any) -> JobSpec:
    return JobSpec.from_dict({"task": "disttrain.examples.chargpt:make_task",
                              "task_args": {"layers": 3}}, overrides)


def test_the_model_checks_pass_what_fits_and_skip_what_they_cannot_know() -> None:
    check_mesh_fits(_spec(tp=2, nproc_per_node=2))
    check_mesh_fits(_spec(pp=3, nproc_per_node=3))
    check_mesh_fits(_spec())                          # plain data parallel: no model built
    auto = _spec(tp=-1, nproc_per_node="auto")        # the world is known only in the ranks
    assert degrees_before_launch(auto) is None
    check_mesh_fits(auto)
    with pytest.raises(StrategyError, match="does not divide the model's 4 heads"):
        check_mesh_fits(auto, nproc=3)                # k8s: the pod's GPUs fix it
    with pytest.raises(SpecError, match="multiply to 2 but the world size is 3"):
        check_mesh_fits(_spec(tp=2, pp=1, dp_shard=1, nproc_per_node="auto"), nproc=3)


def test_builds_model_says_when_the_check_builds_the_model() -> None:
    """`disttrain run` imports what the model check needs before it forks its warm server
    (`cli/run_cmd._prewarm`): only for a job whose check builds the model, and never for
    degrees refused before that."""
    assert builds_model(_spec(tp=2, nproc_per_node=2)) is True
    assert builds_model(_spec(pp=3, nproc_per_node=3)) is True
    assert builds_model(_spec()) is False                             # plain data parallel
    assert builds_model(_spec(dp_shard=2, nproc_per_node=2)) is False  # tp = pp = 1
    assert builds_model(_spec(tp=-1, nproc_per_node="auto"), nproc=2) is True
    assert builds_model(_spec(tp=4, dp_shard=1, nproc_per_node="auto"), nproc=2) is False  # refused
