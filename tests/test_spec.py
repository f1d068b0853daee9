"""JobSpec: defaults, overrides, and bad input named precisely."""

from __future__ import annotations

import pytest

from disttrain.errors import SpecError
from disttrain.spec.job import JobSpec, field_index


def test_defaults_are_the_main_job():
    spec = JobSpec()
    assert spec.workload == "digits"
    assert spec.train.strategy == "ddp" and spec.train.epochs == 10
    assert spec.launch.nproc_per_node == "auto" and spec.launch.launcher == "torchrun"
    assert str(spec.run_dir) == "runs/disttrain"


def test_field_names_unique_across_sections():
    index = field_index()
    assert index["epochs"][0] == "train"
    assert index["nproc_per_node"][0] == "launch"
    assert index["gpus"][0] == "cluster"


def test_yaml_file_and_flag_override(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("name: mnist-ddp\ntrain: {epochs: 3, lr: 0.01}\nlaunch: {nproc_per_node: 4}\n")
    spec = JobSpec.from_yaml(f, {"epochs": 5})
    assert spec.name == "mnist-ddp"
    assert spec.train.epochs == 5 and spec.train.lr == 0.01
    assert spec.launch.nproc_per_node == 4


def test_roundtrip_yaml(tmp_path):
    spec = JobSpec.from_dict({}, {"epochs": 2, "gpus": 2, "batch_size": 64})
    f = tmp_path / "job.yaml"
    f.write_text(spec.to_yaml())
    assert JobSpec.from_yaml(f) == spec


@pytest.mark.parametrize(("data", "needle"), [
    ({"train": {"epochz": 3}}, "train.epochz: unknown field; known fields here:"),
    ({"train": {"strategy": "horovod"}}, "train.strategy: must be one of 'none', 'dp', 'ddp' or 'fsdp'"),
    ({"train": {"epochs": 0}}, "train.epochs: Input should be greater than or equal to 1 (got 0)"),
    ({"name": "My_Job"}, "name: must be a DNS-1123 label"),
    ({"launch": {"nproc_per_node": 0}}, "launch.nproc_per_node"),
    ({"launch": {"master_port": 70000}}, "launch.master_port"),
    ({"bogus": 1}, "bogus: unknown field"),
    ({"script": "a.py", "example": "digits"}, "either 'script' or 'example'"),
    ({"cluster": {"kind": "deployment"}}, "cluster.kind: must be one of"),
])
def test_bad_values_name_the_field(data, needle):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict(data, source="job.yaml")
    assert needle in str(err.value)
    assert str(err.value).startswith("job.yaml: ")


def test_bad_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("train:\n  epochs: [1, 2\n")
    with pytest.raises(SpecError, match=r"job.yaml: line \d+: not valid YAML"):
        JobSpec.from_yaml(f)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        JobSpec.from_yaml(tmp_path / "nope.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        JobSpec.from_yaml(f)


def test_unknown_override():
    with pytest.raises(SpecError, match="unknown option 'epoch'"):
        JobSpec.from_dict({}, {"epoch": 3})
