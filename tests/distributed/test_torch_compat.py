"""The torch a job needs (distributed/torch_compat.py): the table, version and tag parsing,
the worker's check at start and the local launcher's, with the running torch monkeypatched."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from disttrain import worker
from disttrain.distributed import torch_compat as tc
from disttrain.errors import LaunchError, TorchVersionError
from disttrain.spec.job import JobSpec


def _spec(**train: Any) -> JobSpec:
    return JobSpec.from_dict({"train": train})


@pytest.mark.parametrize(("text", "version"), [
    ("2.1.0", (2, 1, 0)), ("2.1.0+cu121", (2, 1, 0)), ("2.5.0a0+gitabc", (2, 5, 0)),
    ("2.13.0+cpu", (2, 13, 0)), ("2.4", (2, 4)), ("v2.3.1", (2, 3, 1)), ("nightly", None), ("", None),
])
def test_parse_version(text: str, version: tuple[int, ...] | None) -> None:
    assert tc.parse_version(text) == version


@pytest.mark.parametrize(("image", "version"), [
    ("pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime", (2, 1, 0)),
    ("117.50.188.237:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime", (2, 1, 0)),
    ("pytorch/pytorch:2.4.1-cuda12.4-cudnn9-devel", (2, 4, 1)),
    ("pytorch/pytorch:2.3", (2, 3)),
    ("docker.io/pytorch/pytorch:1.13.1-cuda11.6-cudnn8-runtime", (1, 13, 1)),
    ("pytorch/pytorch:latest", None),                    # no version in the tag
    ("pytorch/pytorch", None),                           # no tag
    ("registry:5000/pytorch/pytorch", None),             # the colon is a port
    ("nvcr.io/nvidia/pytorch:24.01-py3", None),          # NGC: a release date, not torch's
    ("registry.local/ml/train:2.1.0", None),             # a team's own versioning
    ("pytorch/pytorch@sha256:" + "a" * 64, None),        # a digest
    ("pytorch/pytorch:2.1.0rc", None),                   # not a plain version
])
def test_image_torch_reads_only_official_style_tags(image: str, version: Any) -> None:
    assert tc.image_torch(image) == version


def test_what_each_job_needs() -> None:
    assert tc.torch_needs(_spec()) == []  # ddp: disttrain's floor only
    assert tc.minimum_torch(_spec()) == (tc.TORCH_MIN, None)
    plain = [n.key for n in tc.torch_needs(_spec(strategy="fsdp", checkpoint_every_epochs=0))]
    assert plain == ["fsdp"]
    ckpt = _spec(strategy="fsdp")  # checkpoints every epoch by default
    assert [n.key for n in tc.torch_needs(ckpt)] == ["fsdp", "fsdp_checkpoints"]
    version, need = tc.minimum_torch(ckpt)
    assert version == (2, 3) and need is not None and need.what == "strategy fsdp with checkpoints"
    fp16 = _spec(strategy="fsdp", precision="fp16", checkpoint_every_epochs=0)
    assert [n.key for n in tc.torch_needs(fp16)] == ["fsdp", "fsdp_fp16"]
    restarts = JobSpec.from_dict({"train": {"strategy": "fsdp", "checkpoint_every_epochs": 0},
                                  "launch": {"max_restarts": 1}})
    assert "fsdp_checkpoints" in [n.key for n in tc.torch_needs(restarts)]  # a pod resumes
    # a user's script runs with whatever torch it was written for
    assert tc.torch_needs(JobSpec.from_dict({"script": "train.py",
                                             "train": {"strategy": "fsdp"}})) == []


def test_check_names_each_feature_and_the_fix() -> None:
    tc.check_torch(_spec(), "2.1.0")
    tc.check_torch(_spec(strategy="fsdp"), "2.3.0+cu121")
    tc.check_torch(_spec(strategy="fsdp"), "not a version")  # unknown: nothing to say
    with pytest.raises(TorchVersionError) as err:
        tc.check_torch(_spec(strategy="fsdp"), "2.1.0", source="this process")
    msg = str(err.value)
    assert "strategy fsdp needs torch >= 2.2" in msg
    assert "strategy fsdp with checkpoints needs torch >= 2.3" in msg
    assert "(this process has torch 2.1.0)" in msg and "torch >= 2.3 or --strategy ddp" in msg
    with pytest.raises(TorchVersionError, match=r"--checkpoint-every-epochs 0") as err:
        tc.check_torch(_spec(strategy="fsdp"), "2.2.2")
    assert "needs torch >= 2.2" not in str(err.value)  # 2.2 has plain FSDP
    with pytest.raises(TorchVersionError, match=r"disttrain needs torch >= 2.1 \(this process "
                                                r"has torch 2.0.1\); use an image with torch >= 2.1$"):
        tc.check_torch(_spec(), "2.0.1")


def test_the_floor_is_pyprojects() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)', text)
    assert floor is not None and tc.parse_version(floor.group(1)) == tc.TORCH_MIN


def test_require_and_at_least_read_the_running_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tc, "running_torch", lambda: "2.2.1+cu121")
    assert tc.at_least(2, 2) and not tc.at_least(2, 3)
    with pytest.raises(TorchVersionError, match=r"local launcher .* needs torch >= 2.3 .*"
                                                r"this torch is 2.2.1\+cu121"):
        tc.require("launcher")
    monkeypatch.setattr(tc, "running_torch", lambda: "2.3.0")
    tc.require("launcher")


def test_local_launcher_names_the_torch_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.launch.plan import launch_config
    from disttrain.spec.job import LaunchSpec

    monkeypatch.setattr(tc, "running_torch", lambda: "2.2.0")
    with pytest.raises(LaunchError, match=r"needs torch >= 2.3"):
        launch_config(LaunchSpec(), 2, name="t", start_method="spawn")


def test_worker_refuses_a_job_its_torch_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """In a pod: exit 2 with one line before any rank builds anything."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(_spec(strategy="fsdp").to_yaml())
    monkeypatch.setattr(worker, "running_torch", lambda: "2.1.0")
    started: list[Any] = []
    monkeypatch.setattr(worker, "run_recorded", lambda *a: started.append(a))
    assert worker.main(["--spec", str(spec_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: strategy fsdp needs torch >= 2.2") and err.count("\n") == 1
    assert "this process has torch 2.1.0" in err
    assert started == []
    monkeypatch.setattr(worker, "running_torch", lambda: "2.4.0")
    assert worker.main(["--spec", str(spec_file)]) == 0 and len(started) == 1


def test_fused_adam_on_cpu_only_where_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from disttrain.train.optim import build_optimizer, fused_supported

    params = [torch.nn.Parameter(torch.zeros(3))]
    monkeypatch.setattr(tc, "running_torch", lambda: "2.3.1")
    assert not fused_supported(params)  # torch 2.1-2.3's Adam raises for fused CPU params
    assert not build_optimizer("adam", params, 0.1).defaults.get("fused")
    monkeypatch.setattr(tc, "running_torch", lambda: "2.4.0")
    assert fused_supported(params)
