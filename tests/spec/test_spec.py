"""JobSpec: defaults, overrides, and bad input named precisely."""

from __future__ import annotations

import re

import pytest

from disttrain.errors import SpecError
from disttrain.spec.job import JobSpec, field_index


def test_defaults_are_the_main_job():
    spec = JobSpec()
    assert spec.task == "disttrain.examples.digits:make_task" and spec.name == "disttrain"
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


# -- one strict base for every section ---------------------------------------------------
@pytest.mark.parametrize(("data", "needle"), [
    ({"cluster": {"image": "a\x00b"}}, "cluster.image: must not contain a NUL character"),
    ({"cluster": {"env": {"A": "a\x00b"}}}, "cluster.env: must not contain a NUL character"),
    ({"cluster": {"env": {"A\x00": "b"}}}, "cluster.env: must not contain a NUL character"),
    ({"cluster": {"scheduler": "hami\x00"}}, "cluster.scheduler: must not contain a NUL"),
    ({"cluster": {"node_selector": {"gpu": "a\x00"}}}, "cluster.node_selector: must not"),
    ({"cluster": {"gpu_type": ["A100\x00"]}}, "cluster.gpu_type: must not contain a NUL"),
    ({"cluster": {"cpu": {"request": "1\x00"}}}, "cluster.cpu.request"),
    ({"cluster": {"code": {"host_path": "/c\x00"}}}, "cluster.code.host_path: must not"),
    ({"cluster": {"volumes": [{"name": "d", "mount": "/d", "host_path": "/d\x00"}]}},
     "cluster.volumes.0.host_path: must not contain a NUL"),
    ({"cluster": {"imagez": "x"}}, "cluster.imagez: unknown field"),
])
def test_cluster_section_is_as_strict_as_the_others(data, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        JobSpec.from_dict(data)


@pytest.mark.parametrize("name", ["job\n", "a" * 64, "-job", "Job"])
def test_names_are_whole_dns1123_labels(name):
    """`$` in a regex also matches before a final newline: "job\\n" must not pass."""
    with pytest.raises(SpecError, match="name: must be a DNS-1123 label"):
        JobSpec.from_dict({"name": name})
    with pytest.raises(SpecError, match="namespace"):
        JobSpec.from_dict({"cluster": {"namespace": name}})


def test_one_quantity_grammar():
    from decimal import Decimal

    from disttrain.k8s.render import quantity
    from disttrain.spec.fields import check_quantity, parse_quantity

    for text, value in [("8Gi", 8 * 2**30), ("500m", Decimal("0.5")), ("1e3", 1000),
                        ("+2", 2), ("1.5k", 1500), ("1E", 10**18)]:
        assert parse_quantity(text) == value == quantity(text)
        assert check_quantity(text, "cpu") == text
    for text in ("2\n", "x", "1.", "8GB", "-1", "٣"):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            parse_quantity(text)
        with pytest.raises(SpecError, match=r"cluster\.cpu\.request"):
            JobSpec.from_dict({"cluster": {"cpu": {"request": text}}})


def test_choice_lists_are_the_field_literals():
    import typing

    from disttrain.k8s import hami
    from disttrain.spec import fields
    from disttrain.spec.cluster import ClusterSpec
    from disttrain.spec.job import TrainSpec

    assert typing.get_args(fields.Example) == fields.EXAMPLES
    assert typing.get_args(TrainSpec.model_fields["comm_hook"].annotation) == fields.COMM_HOOKS
    assert set(hami.WORKAROUNDS) == set(fields.VGPU_WORKAROUNDS)
    assert set(hami.NCCL_PRESETS) == set(fields.NCCL_PRESET_NAMES)
    assert typing.get_args(ClusterSpec.model_fields["vgpu_workarounds"].annotation) == (
        fields.VgpuWorkaround,)


def _strip_none(info) -> object:
    import typing

    return next(a for a in typing.get_args(info.annotation) if a is not type(None))


# -- cross-field rules: at load time, naming the flag to change ---------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    ({"strategy": "dp", "nproc_per_node": 2},
     "flags: launch.nproc_per_node: strategy dp runs ONE process that drives all visible GPUs "
     "(nn.DataParallel), not 2; use --nproc-per-node 1, or --strategy ddp for one process per "
     "GPU (recommended)"),
    ({"strategy": "dp", "nnodes": 3, "nproc_per_node": 1},
     "flags: launch.nnodes: strategy dp is one process on one machine, not 3 nodes; use "
     "--strategy ddp across nodes"),
    ({"strategy": "fsdp", "comm_hook": "powersgd"},
     "flags: train.comm_hook: powersgd is a DDP comm hook and FSDP has none; use --strategy "
     "ddp, or --comm-hook bf16/fp16 with fsdp"),
])
def test_builtin_job_combinations_are_refused_at_load(overrides, message):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict({}, overrides, source="flags")
    assert str(err.value) == message
    JobSpec.from_dict({"script": "train.py"}, overrides)  # a script reads its own arguments


# -- host rules: check_runnable, shared by `disttrain run` and every rank ----------------
def test_check_runnable_refusals():
    from disttrain.errors import PrecisionError, StrategyError
    from disttrain.spec.rules import check_runnable

    spec = JobSpec.from_dict
    with pytest.raises(PrecisionError, match=r"^train\.precision: fp16 autocast needs a CUDA GPU; "
                                             r"on CPU use --precision bf16$"):
        check_runnable(spec({}, {"precision": "fp16"}), gpus=0)
    assert check_runnable(spec({}, {"precision": "fp16"}), gpus=1) == []
    assert check_runnable(spec({"script": "t.py"}, {"precision": "fp16"}), gpus=0) == []
    with pytest.raises(SpecError, match=r"^launch\.backend: nccl needs CUDA GPUs"):
        check_runnable(spec({"script": "t.py"}, {"backend": "nccl"}), gpus=0)
    with pytest.raises(StrategyError, match=r"^WORLD_SIZE=2: strategy dp is ONE process"):
        check_runnable(spec({}, {"strategy": "dp", "launcher": "env"}), gpus=0, world_size=2)
    with pytest.raises(StrategyError, match="this job has 4 processes; use --nproc-per-node 1"):
        check_runnable(spec({}, {"strategy": "dp"}), gpus=2, world_size=4)


def test_check_runnable_notes_the_dp_advice_once():
    from disttrain.spec.rules import DP_ADVICE, check_runnable

    assert check_runnable(JobSpec.from_dict({}, {"strategy": "dp"}), gpus=0, world_size=1) == [
        DP_ADVICE]
    assert check_runnable(JobSpec(), gpus=0) == []


def test_spec_and_rules_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, disttrain.spec.rules, disttrain.spec.paths, disttrain.spec.job; "
            "assert 'torch' not in sys.modules, 'spec imports torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- task: the user's TrainTask (issue 13) ---------------------------------------------------
@pytest.mark.parametrize(("data", "needle"), [
    ({"task": "mytask:make_task", "script": "train.py"},
     "job.yaml: task: give either 'task' (a TrainTask the built-in Trainer trains) or 'script'"),
    ({"task": "mytask:make_task", "example": "digits"},
     "job.yaml: task: give either 'task' (your TrainTask) or 'example' (a built-in job, short for "
     "task: disttrain.examples.digits:make_task), not both"),
    ({"script": "a.py", "task_args": {"hidden": 256}},
     "job.yaml: task_args: they are the arguments of a task's function, and a script takes its own"),
    ({"train": {"data_dir": "/x"}}, "job.yaml: train.data_dir: an example option is a task argument "
                                    "now: write task_args: {data_dir: /x} (or --data-dir)"),
    ({"example": "imagenet"}, "job.yaml: example: must be one of digits, mnist"),
    ({"task": "x/my-task.py:make"}, "'my-task.py': a task file's name must be an importable module"),
    ({"task": "mytask"},
     "job.yaml: task: write it as module:function (e.g. mytask:make_task) (got 'mytask')"),
    ({"task": "my-task:make"}, "job.yaml: task: 'my-task' is not an importable module name"),
    ({"task": "mytask:make-task"}, "job.yaml: task: write it as module:function"),
    ({"task": "m:f", "task_args": {"hidden": float("inf")}}, "task_args: hidden: must be a finite number"),
    ({"task": "m:f", "task_args": {"x": [1, {"y": float("nan")}]}}, "task_args: x: must be a finite number"),
    ({"task": "m:f", "task_args": {"x": "a\x00b"}}, "task_args: must not contain a NUL character"),
    ({"task": "m:f", "task_args": {"2x": 1}}, "task_args: '2x' is not a keyword argument name"),
    ({"task": "m:f", "task_args": [1, 2]}, "task_args: Input should be a valid dictionary"),
    ({"task": "m:f", "train": {"strategy": "dp", "sync_batchnorm": True}},
     "train.sync_batchnorm: SyncBatchNorm syncs the statistics of one process per GPU"),
    # the built-in Trainer trains a task, so the train-only rules hold for it too
    ({"task": "m:f", "train": {"strategy": "fsdp", "comm_hook": "powersgd"}},
     "train.comm_hook: powersgd is a DDP comm hook"),
    ({"task": "m:f", "train": {"strategy": "dp"}, "launch": {"nproc_per_node": 2}},
     "launch.nproc_per_node: strategy dp runs ONE process"),
])
def test_bad_task_fields_name_the_field(data, needle):
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict(data, source="job.yaml")
    assert needle in str(err.value)


def test_task_spec_roundtrips_and_is_a_task_workload(tmp_path):
    import datetime

    spec = JobSpec.from_dict({"task": "tasks/my.py:make_task",
                              "task_args": {"hidden": 256, "sizes": [1, 2.5], "opts": {"a": None}},
                              "train": {"sync_batchnorm": True}})
    assert spec.task == "tasks/my.py:make_task" and spec.train.sync_batchnorm is True
    f = tmp_path / "job.yaml"
    f.write_text(spec.to_yaml())
    assert JobSpec.from_yaml(f) == spec
    assert JobSpec(script="a.py").task is None and JobSpec().train.sync_batchnorm is False
    with pytest.raises(SpecError, match=r"task_args: d: must be a YAML/JSON value .* got date"):
        JobSpec.from_dict({"task": "m:f", "task_args": {"d": datetime.date(2024, 2, 1)}})


def test_one_kind_of_job_and_names_from_the_task_or_script():
    """Every Trainer job is a task reference: the old `example:` maps to its reference, an
    old job.yaml's unset example fields still load, and an unnamed job is named after its
    task or script (issue 25 item 8); the built-in default job keeps `disttrain`."""
    assert JobSpec(example="mnist").task == "disttrain.examples.mnist:make_task"
    assert JobSpec.from_dict({}, {"example": "seed002"}).task == "disttrain.examples.seed002:make_task"
    assert JobSpec(example="chargpt").name == "chargpt"
    assert JobSpec(task="disttrain.examples.digits:make_task").name == "digits"
    assert JobSpec(task="/abs/x/my_task.py:make_task").name == "my-task"
    assert JobSpec(task="pkg.mod:build_small").name == "mod-build-small"
    assert JobSpec(script="dir/multigpu_torchrun.py").name == "multigpu-torchrun"
    assert JobSpec(task="m:f", name="mine").name == "mine"
    old_dump = {"example": None, "train": {"data_dir": None, "download": False, "num_samples": None,
                                           "input_size": None, "hidden_size": 512, "epochs": 2}}
    spec = JobSpec.from_dict(old_dump)
    assert spec.task == "disttrain.examples.digits:make_task" and spec.train.epochs == 2
    dumped = spec.model_dump()
    assert "data_dir" not in dumped["train"] and "example" not in dumped


def test_task_syntax_check_is_the_loaders():
    """The spec's check and `train.task.parse_reference` accept and refuse the same refs."""
    from disttrain.spec.fields import parse_task_reference
    from disttrain.train.task import TaskError, parse_reference

    assert parse_task_reference("tasks/my.py:make") == parse_reference("tasks/my.py:make")
    assert parse_task_reference("tasks/my.py:make") == ("my", "make")  # its folder goes on the path
    assert parse_task_reference("/abs/../x/my.py:make") == ("my", "make")
    assert parse_task_reference("pkg.mod:f") == ("pkg.mod", "f")
    for bad in ("nocolon", ":f", "m:", "m:1f", "a-b:f", "m:f.g"):
        with pytest.raises(ValueError):
            parse_task_reference(bad)
        with pytest.raises(TaskError, match=re.escape(f"task {bad!r}: ")):
            parse_reference(bad)


def test_task_flags_are_generated():
    """--task, --task-args (a YAML/JSON mapping) and --sync-batchnorm come from the fields;
    task_dir is the CLI's to set, not a flag."""
    from click.testing import CliRunner

    from disttrain.cli.options import YamlValue, collect_overrides
    from disttrain.cli.run_cmd import run

    assert YamlValue().convert('{"hidden": 256}', None, None) == {"hidden": 256}
    assert YamlValue().convert("{hidden: 256, sizes: [1, 2]}", None, None) == {"hidden": 256, "sizes": [1, 2]}

    kwargs = {"task": "m:f", "task_args": {"hidden": 256}, "sync_batchnorm": True, "epochs": None}
    assert collect_overrides(kwargs) == {"task": "m:f", "task_args": {"hidden": 256}, "sync_batchnorm": True}
    help_text = CliRunner().invoke(run, ["--help"]).output
    assert "--task TEXT" in help_text and "--task-args YAML" in help_text
    assert "--sync-batchnorm / --no-sync-batchnorm" in help_text and "--task-dir" not in help_text
