"""A `task: module:function` on the cluster: what render ships in the code ConfigMap (the
module, its package, its local imports), where the pod finds it, what the image must hold
(disttrain, a torch new enough for the job), and the golden render of tests/k8s/data/task.

Regenerate the golden after an intended change with
`DISTTRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/k8s/test_render_task.py`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import GOLDEN, HERE, validate_all
from disttrain.errors import CodeError, SpecError, TorchVersionError
from disttrain.k8s.code import CONFIGMAP_LIMIT
from disttrain.k8s.render import render, to_yaml
from disttrain.spec.job import JobSpec

TASK_DATA = HERE / "data" / "task"
IMG = "registry.local:30000/ml/train:1"
GUIDE_IMG = "117.50.188.237:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime"


@pytest.fixture
def task_dir(workdir: Path) -> Path:
    """tests/k8s/data/task copied to the current folder."""
    shutil.copytree(TASK_DATA, workdir, dirs_exist_ok=True)
    return workdir


def _spec(task: str = "mytask:make_task", **cluster: Any) -> JobSpec:
    return JobSpec.from_dict({"task": task, "cluster": {"image": IMG, "image_has_disttrain": True,
                                                        **cluster}})


def _shipped(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    cm, pod = objects[0], objects[-1]
    assert cm["kind"] == "ConfigMap" and pod["kind"] == "Pod"
    return cm, pod


def _mounts(pod: dict[str, Any]) -> dict[str, str]:
    """mountPath -> ConfigMap key of the pod's subPath mounts."""
    return {m["mountPath"]: m["subPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]
            if "subPath" in m}


def test_the_module_its_package_imports_and_local_modules_are_shipped(task_dir: Path) -> None:
    cm, pod = _shipped(render(_spec(), task_dir).objects)
    assert _mounts(pod) == {
        "/workspace/mytask.py": "mytask.py", "/workspace/blocks/__init__.py": "blocks____init__.py",
        "/workspace/blocks/mlp.py": "blocks__mlp.py", "/workspace/helpers.py": "helpers.py",
        "/etc/disttrain/job.yaml": "job.yaml"}
    for path, key in _mounts(pod).items():  # byte for byte
        if path.startswith("/workspace/"):
            assert cm["data"][key] == (task_dir / path.removeprefix("/workspace/")).read_text()
    assert "unrelated.py" not in cm["data"]  # beside the task, imported by nothing shipped
    shipped = yaml.safe_load(cm["data"]["job.yaml"])
    assert shipped["task"] == "mytask:make_task" and shipped["task_dir"] == "/workspace"
    ctr = pod["spec"]["containers"][0]
    assert ctr["args"] == ["torchrun", "--nproc_per_node=1", "-m", "disttrain.worker",
                              "--spec", "/etc/disttrain/job.yaml"]
    assert ctr["workingDir"] == "/workspace"
    assert pod["metadata"]["labels"]["disttrain.io/workload"] == "task"
    assert pod["metadata"]["labels"]["disttrain.io/needs-disttrain"] == "true"
    head = to_yaml([cm]).splitlines()[0]
    assert head.startswith("# ConfigMap mytask-code -- ships: /workspace/mytask.py (task "
                           "mytask:make_task), ")
    assert "/workspace/helpers.py (imported by mytask.py)" in head
    assert "/workspace/blocks/mlp.py (package blocks, imported by mytask.py)" in head
    assert "image needs: torch >= 2.1 and disttrain (task mytask:make_task" in to_yaml([pod])
    validate_all([cm, pod])


def test_imports_are_followed_transitively_and_only_inside_task_dir(workdir: Path) -> None:
    (workdir / "a.py").write_text("import os\nimport b\n\ndef make_task():\n    pass\n")
    (workdir / "b.py").write_text("try:\n    from c.deep import x\nexcept ImportError:\n"
                                  "    import not_here\nimport yaml\n")
    (workdir / "c").mkdir()
    (workdir / "c" / "deep.py").write_text("from . import sibling\nx = 1\n")
    (workdir / "c" / "sibling.py").write_text("")
    (workdir / "c" / "notes.txt").write_text("not python: not shipped\n")
    (workdir / "os.py").write_text("")  # would shadow os in the pod as it does here
    cm, _ = _shipped(render(_spec("a:make_task"), workdir).objects)
    assert sorted(cm["data"]) == ["a.py", "b.py", "c__deep.py", "c__sibling.py", "job.yaml", "os.py"]


def test_a_module_in_a_package_ships_the_package_folder(workdir: Path) -> None:
    (workdir / "tasks" / "models").mkdir(parents=True)
    (workdir / "tasks" / "train.py").write_text("from .models import net\n")
    (workdir / "tasks" / "models" / "net.py").write_text("")
    (workdir / "tasks" / "__pycache__").mkdir()
    (workdir / "tasks" / "__pycache__" / "stale.py").write_text("")
    cm, pod = _shipped(render(_spec("tasks.train:make_task"), workdir).objects)
    assert sorted(cm["data"]) == ["job.yaml", "tasks__models__net.py", "tasks__train.py"]
    assert "/workspace/tasks/models/net.py" in _mounts(pod)


@pytest.mark.parametrize("ref", ["../x/my_task.py:make_task", "{abs}/x/my_task.py:make_task"])
def test_a_task_file_ships_from_its_own_folder(workdir: Path, ref: str) -> None:
    """`--task ../x/my_task.py:fn` (or an absolute path): the file's folder is the task's
    folder in the pod too, with the modules it imports from there (issue 25 item 9)."""
    (workdir / "x").mkdir()
    (workdir / "here").mkdir()
    (workdir / "x" / "my_task.py").write_text("import helper\n")
    (workdir / "x" / "helper.py").write_text("")
    spec = _spec(ref.format(abs=workdir))
    cm, _ = _shipped(render(spec, workdir / "here").objects)
    assert sorted(cm["data"]) == ["helper.py", "job.yaml", "my_task.py"]
    shipped = yaml.safe_load(cm["data"]["job.yaml"])
    assert shipped["task"] == "my_task:make_task" and shipped["task_dir"] == "/workspace"
    assert cm["metadata"]["name"] == "my-task-code"  # named after the task
    with pytest.raises(SpecError, match="no such file"):
        render(_spec("../x/nope.py:make_task"), workdir / "here")


def test_a_package_wins_over_a_module_of_the_same_name(workdir: Path) -> None:
    (workdir / "dup").mkdir()
    (workdir / "dup" / "__init__.py").write_text("def make_task():\n    pass\n")
    (workdir / "dup.py").write_text("")  # Python imports the package, so it is what ships
    cm, _ = _shipped(render(_spec("dup:make_task"), workdir).objects)
    assert sorted(cm["data"]) == ["dup____init__.py", "job.yaml"]


def test_the_spec_files_folder_is_searched_not_the_current_one(task_dir: Path, cli: Any,
                                                               tmp_path_factory: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(elsewhere)
    result = cli("k8s", "render", "-f", str(task_dir / "job.yaml"))
    assert result.code == 0, result.err
    cm = next(yaml.safe_load_all(result.out))
    assert "mytask.py" in cm["data"] and yaml.safe_load(cm["data"]["job.yaml"])["task_dir"] == "/workspace"


@pytest.mark.parametrize(("files", "ref", "match"), [
    ({}, "mytask:make_task", r"^task 'mytask:make_task': no mytask.py or mytask/ in .*; put "
                             r"mytask.py there \(beside the spec file\), or put the code on a volume"),
    ({"pkg/__init__.py": ""}, "pkg.sub:make_task", r"pkg/ in .* has no pkg/sub.py or pkg/sub/__init__.py"),
    ({"bad.py": "def make_task(:\n"}, "bad:make_task", r"^task: bad.py line 1: .*could not import it"),
    ({"ok.py": "import broken\n", "broken.py": "x = (\n"}, "ok:make_task", r"^task: broken.py line"),
])
def test_a_task_that_cannot_ship_is_refused(workdir: Path, files: dict[str, str], ref: str,
                                            match: str) -> None:
    for name, text in files.items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)
    with pytest.raises(CodeError, match=match):
        render(_spec(ref), workdir)


def test_refusal_on_the_cli_is_one_line_exit_2(cli: Any, workdir: Path) -> None:
    result = cli("k8s", "render", "--task", "nothere:make_task", "--image", IMG,
                 "--image-has-disttrain")
    assert result.code == 2 and result.out == ""
    assert len(result.error_lines) == 1 and "no nothere.py or nothere/" in result.error_lines[0]


def test_disttrains_own_modules_come_from_the_image(workdir: Path) -> None:
    rendered = render(_spec("disttrain.examples.chargpt:make_task"), workdir)
    cm, _ = _shipped(rendered.objects)
    assert list(cm["data"]) == ["job.yaml"] and rendered.warnings == []


def test_a_module_installed_here_ships_nothing_and_says_so(workdir: Path) -> None:
    rendered = render(_spec("yaml:safe_load"), workdir)  # PyYAML: installed, not in workdir
    assert list(_shipped(rendered.objects)[0]["data"]) == ["job.yaml"]
    assert any("yaml is not in" in w and "the image must have it too" in w
               for w in rendered.warnings)


def test_a_configmap_over_the_limit_names_the_volume_fix(workdir: Path) -> None:
    line = "x = 1  # " + "p" * 1000 + "\n"
    big = line * (CONFIGMAP_LIMIT // len(line) // 2 + 10)  # each file under 1 MiB, both over
    (workdir / "mytask.py").write_text("import weights_a\nimport weights_b\n")
    (workdir / "weights_a.py").write_text(big)
    (workdir / "weights_b.py").write_text(big)
    with pytest.raises(CodeError, match=r"over the 1 MiB Kubernetes limit .*put the task's code "
                                        r"in the image or on a volume the pods mount: --code "
                                        r"'\{pvc: NAME, mount: /workspace\}' or '\{host_path: DIR\}'; "
                                        r"then nothing is shipped and task_dir is that mount"):
        render(_spec(), workdir)


@pytest.mark.parametrize("code", [{"pvc": "team-code", "mount": "/code"},
                                  {"host_path": "/opt/code", "mount": "/code"}])
def test_code_on_a_volume_ships_nothing_and_task_dir_is_the_mount(workdir: Path,
                                                                  code: dict[str, str]) -> None:
    cm, pod = _shipped(render(_spec(code=code), workdir).objects)  # no mytask.py here: fine
    assert list(cm["data"]) == ["job.yaml"]
    assert yaml.safe_load(cm["data"]["job.yaml"])["task_dir"] == "/code"
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["code"] == "/code"


def test_a_task_needs_disttrain_in_the_image(task_dir: Path) -> None:
    spec = JobSpec.from_dict({"task": "mytask:make_task", "cluster": {"image": IMG}})
    with pytest.raises(SpecError, match=r"cluster.image: the task mytask:make_task runs "
                                        r"`python -m disttrain.worker` in the pod"):
        render(spec, task_dir)


def test_an_image_whose_tag_names_too_old_a_torch_is_refused(task_dir: Path, cli: Any) -> None:
    result = cli("k8s", "render", "-f", "job.yaml", "--strategy", "fsdp")
    assert result.code == 2 and result.out == ""
    (line,) = result.error_lines
    assert line.startswith("error: strategy fsdp needs torch >= 2.2 (")
    assert "strategy fsdp with checkpoints needs torch >= 2.3" in line
    assert f"(image {GUIDE_IMG} has torch 2.1.0); use an image with torch >= 2.3 or " \
           f"--strategy ddp" in line
    # a tag that names a new enough torch passes, and says so
    new = render(JobSpec.from_dict({"task": "mytask:make_task", "train": {"strategy": "fsdp"},
                                    "cluster": {"image": "pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime",
                                                "image_has_disttrain": True}}), task_dir)
    assert "torch >= 2.3 (strategy fsdp with checkpoints) and disttrain" in to_yaml(new.objects)
    assert "its tag names torch 2.4.1" in to_yaml(new.objects)


def test_an_unknown_tag_passes_with_a_note(task_dir: Path) -> None:
    spec = JobSpec.from_dict({"task": "mytask:make_task", "train": {"strategy": "fsdp"},
                              "cluster": {"image": IMG, "image_has_disttrain": True}})
    pod = render(spec, task_dir).objects[-1]
    assert pod["metadata"]["annotations"]["disttrain.io/image-needs"].endswith(
        "its tag names no torch version, so the worker checks it at start")


def test_the_tag_check_covers_an_install_and_not_a_plain_script(workdir: Path) -> None:
    old = "pytorch/pytorch:2.0.1-cuda11.7-cudnn8-runtime"
    with pytest.raises(TorchVersionError, match=r"disttrain needs torch >= 2.1"):
        render(JobSpec.from_dict({"script": "train.py", "cluster": {
            "image": old, "install_disttrain": "disttrain"}}), workdir)
    # a script without disttrain runs on whatever torch it was written for
    render(JobSpec.from_dict({"script": "train.py", "cluster": {"image": old}}), workdir)


def test_task_golden(task_dir: Path, cli: Any) -> None:
    result = cli("k8s", "render", "-f", "job.yaml")
    assert result.code == 0, result.err
    path = GOLDEN / "task_job.yaml"
    if os.environ.get("DISTTRAIN_UPDATE_GOLDEN"):
        path.write_text(result.out)
    got, want = _without_spec(result.out), _without_spec(path.read_text())
    assert got == want, f"render differs from {path}"
    validate_all(list(yaml.safe_load_all(result.out)))


def _without_spec(text: str) -> list[Any]:
    """The documents, the shipped job.yaml reduced to its task fields (it lists every
    JobSpec field: a new one elsewhere must not break this golden)."""
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            shipped = yaml.safe_load(doc["data"]["job.yaml"])
            doc["data"]["job.yaml"] = {k: shipped[k] for k in ("name", "task", "task_args", "task_dir")}
        if doc["kind"] == "Job":  # the ConfigMap's hash, job.yaml included
            doc["spec"]["template"]["metadata"]["annotations"].pop("disttrain.io/code-sha256")
    return docs
