"""Bad input: one clear `error:` line, exit 2, no traceback, nothing sent to the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from k8s_fake_apiserver import FakeApiServer

IMG = ["--image", "registry.local/ml/train:1"]

BAD: dict[str, tuple[list[str], str]] = {
    "name-not-dns1123": (["train.py", "--name", "My_Job", *IMG], "DNS-1123"),
    "unknown-field-in-file": (["-f", "bad_field.yaml"], "unknown field"),
    "unknown-flag-yaml": (["train.py", "--code", "{hostpath: /x}", *IMG], "unknown field"),
    "gpumem-8Gi": (["train.py", "--gpumem", "8Gi", *IMG], "write 8192"),
    "gpucores-150": (["train.py", "--gpucores", "150", *IMG], "gpucores"),
    "percentage-0": (["train.py", "--gpumem-percentage", "0", *IMG], "gpumem_percentage"),
    "more-ranks-than-gpus": (["train.py", "--gpus", "2", "--nproc-per-node", "4", *IMG],
                             "nproc_per_node"),
    "missing-image": (["train.py", "--kind", "job", "--nnodes", "2"], "cluster.image"),
    "missing-script": (["nope.py", *IMG], "nope.py: no such file"),
    "configmap-over-1MiB": (["train.py", "--code", "{files: [big.bin]}", *IMG], "1 MiB"),
    "builtin-without-disttrain": (IMG, "needs disttrain"),
    "pod-with-2-nodes": (["train.py", "--nnodes", "2", *IMG], "kind pod runs one node"),
    "bad-volume-yaml": (["train.py", "--volumes", "[{name: data}]", *IMG], "volumes"),
}


@pytest.fixture
def inputs(workdir: Path) -> Path:
    (workdir / "bad_field.yaml").write_text("cluster:\n  gpu: 2\n")
    (workdir / "big.bin").write_bytes(b"x" * (1024 * 1024 + 1))
    return workdir


def _one_error(result: Any, match: str) -> None:
    assert result.code == 2, (result.out, result.err)
    assert "Traceback" not in result.err + result.out
    assert len(result.error_lines) == 1, result.err
    assert match in result.error_lines[0], result.err
    assert result.out == ""


@pytest.mark.parametrize("case", sorted(BAD))
def test_render_bad_input(case: str, cli: Any, inputs: Path) -> None:
    args, match = BAD[case]
    _one_error(cli("k8s", "render", *args), match)


@pytest.mark.parametrize("case", sorted(BAD))
def test_apply_bad_input_applies_nothing(case: str, cli: Any, inputs: Path,
                                         fake_api: FakeApiServer) -> None:
    args, match = BAD[case]
    _one_error(cli("k8s", "apply", *args), match)
    assert fake_api.state.requests == []  # the cluster was never contacted


def test_spec_file_that_does_not_exist(cli: Any, workdir: Path) -> None:
    _one_error(cli("k8s", "render", "-f", "missing.yaml", *IMG), "missing.yaml")


def test_run_local_bad_input_sets_nothing_up(cli: Any, inputs: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import disttrain.k8s.local as local

    monkeypatch.setattr(local, "check_host", lambda: None)
    monkeypatch.setattr(local, "network", _must_not_be_called)
    _one_error(cli("k8s", "run-local", "nope.py"), "nope.py: no such file")
    _one_error(cli("k8s", "run-local", "train.py", "--gpumem", "8Gi"), "write 8192")


def _must_not_be_called(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("run-local set up namespaces for bad input")
