"""`k8s render` of a script ships the files it execs and opens beside it, warns about the
imports the official image lacks (not torchvision, numpy), and about saves into the pod's
working directory (issue 25 item 7). A reduced single-file trainer of our own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import validate_all
from disttrain.k8s.render import render
from disttrain.spec.job import JobSpec

OFFICIAL = "registry.local:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime"
TRAIN = '''import os
import numpy as np
import torch
import torchvision
import wandb
import yaml
from PIL import Image

out_dir = "out"
exec(open("configurator.py").read())
with open("config.yaml") as f:
    cfg = yaml.safe_load(f)
extra = open("extra.yaml").read()
torch.save({"w": 1}, os.path.join(out_dir, "ckpt.pt"))
np.save("stats.npy", np.zeros(2))
with open("log.txt", "w") as f:
    f.write("done")
'''
FILES = {"train.py": TRAIN, "configurator.py": "import sys\nimport omegaconf\n",
         "config.yaml": "lr: 0.1\n", "unrelated.txt": "not opened\n"}


def _render(folder: Path, image: str, **cluster: Any) -> tuple[set[str], list[str]]:
    spec = JobSpec.from_dict({"script": "train.py",
                              "cluster": {"image": image, "gpus": 1, **cluster}})
    rendered = render(spec, folder)
    validate_all(rendered.objects)
    (cm,) = [o for o in rendered.objects if o["kind"] == "ConfigMap"]
    return set(cm.get("data", {})), rendered.warnings


def test_script_files_images_and_lost_saves(tmp_path: Path) -> None:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    shipped, warnings = _render(tmp_path, OFFICIAL)
    assert shipped == {"train.py", "configurator.py", "config.yaml"}
    imports = sorted(w.split(" imports ")[1].split(",")[0] for w in warnings if " imports " in w)
    # the official image has torchvision, numpy, PIL, yaml; the exec'd file's import counts
    assert imports == ["omegaconf", "wandb"]
    (missing,) = [w for w in warnings if "extra.yaml" in w]
    assert "train.py:13 opens extra.yaml, which is not in" in missing
    assert "FileNotFoundError" in missing
    (lost,) = [w for w in warnings if "vanish" in w]
    assert "out/ckpt.pt (train.py:14), stats.npy (train.py:15), log.txt (train.py:16)" in lost
    assert "/workspace" in lost and "--volumes" in lost

    # another image: nothing is known about it beyond torch
    _, warnings = _render(tmp_path, "registry.local:30000/team/train:1")
    imports = {w.split(" imports ")[1].split(",")[0] for w in warnings if " imports " in w}
    assert {"torchvision", "numpy", "PIL", "wandb"} <= imports

    # a volume at the folder it saves into keeps that save
    vol = {"volumes": [{"name": "out", "pvc": "runs", "mount": "/workspace/out"}]}
    _, warnings = _render(tmp_path, OFFICIAL, **vol)
    (lost,) = [w for w in warnings if "vanish" in w]
    assert "ckpt.pt" not in lost and "stats.npy" in lost
