"""`k8s render` of the causal-LM recipe with the deployment guide's cluster section: the
models PVC mounted read-only at /models, the result on a PVC, schema-valid; and the
warning when train.output_dir would land where it does not outlive the pod."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import validate_all
from disttrain.k8s.output_place import output_dir_warning
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec

VOLUMES = [{"name": "models", "pvc": "nfs-modelscope", "mount": "/models", "read_only": True},
           {"name": "data", "pvc": "nfs-training-data", "mount": "/data"},
           {"name": "output", "pvc": "finetune-output", "mount": "/output"}]


def _spec(output_dir: str | None = "/output/qwen-lora", volumes: list[dict[str, Any]] = VOLUMES,
          **cluster: Any) -> JobSpec:
    return JobSpec.from_dict({
        "name": "qwen-lora", "task": "disttrain.recipes.causal_lm:make_task",
        "task_args": {"model": "/models/Qwen2.5-0.5B", "data": "/data/train.jsonl", "lora": {"r": 8}},
        "launch": {"nproc_per_node": 2},
        "train": {"output_dir": output_dir, "run_dir": "/output/runs/qwen-lora", "precision": "bf16"},
        "cluster": {"kind": "job", "image": "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime",
                    "install_disttrain": "disttrain[peft]", "gpus": 2, "gpumem": "12k",
                    "memory": {"request": "8Gi", "limit": "16Gi"}, "volumes": volumes,
                    "env": {"HF_ENDPOINT": "https://hf-mirror.com"}, **cluster}})


def test_the_recipe_renders_schema_valid_with_models_read_only_and_output_on_a_pvc() -> None:
    rendered = render(_spec())
    validate_all(rendered.objects)
    assert not any("output_dir" in w for w in rendered.warnings), rendered.warnings
    job = rendered.objects[-1]
    pod = job["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/models"].get("readOnly") is True
    assert "readOnly" not in mounts["/output"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims["output"] == "finetune-output" and claims["models"] == "nfs-modelscope"
    assert "output_dir: /output/qwen-lora" in str(rendered.objects[0]["data"])   # the pod's spec


@pytest.mark.parametrize(("output_dir", "volumes", "expect"), [
    ("out/qwen", VOLUMES, "emptyDir"),                     # relative: the workspace
    ("/workspace/qwen", VOLUMES, "emptyDir"),              # the code mount (ConfigMap delivery)
    ("/models/qwen-ft", VOLUMES, "read-only volume models"),
    ("/srv/qwen", VOLUMES, "pod's own filesystem"),
    ("/output/qwen", VOLUMES, None),
    ("/output/qwen", [{"name": "output", "host_path": "/mnt/out", "mount": "/output"}], None),
    (None, VOLUMES, None),
])
def test_output_dir_that_dies_with_the_pod_is_named(output_dir: str | None,
                                                    volumes: list[dict[str, Any]],
                                                    expect: str | None) -> None:
    spec = _spec(output_dir, volumes)
    note = output_dir_warning(spec, "/workspace")
    if expect is None:
        assert note is None
        return
    assert note is not None and expect in note and "--output-dir /output/" in note
    assert any(w == note for w in render(spec).warnings)
