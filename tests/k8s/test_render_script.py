"""A user script's own imports travel with it to the pod (issue 16 item 8), and every
shipped file prints as a block that reads back byte for byte (docs/cluster.md, "What the
ConfigMap ships").

The fixtures reproduce the structure of pytorch/examples' distributed scripts with code of
our own: the DDP tutorial's script beside the `datautils.py` it imports, and minGPT's
`main.py` importing its sibling modules (which import more, and third-party packages the
image may lack).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from conftest import validate_all
from disttrain.k8s.render import render, to_yaml
from disttrain.spec.job import JobSpec

IMG = "registry.local:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime"


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _render(folder: Path, script: str, **cluster: Any) -> tuple[dict[str, Any], list[str], str]:
    spec = JobSpec.from_dict({"script": script, "cluster": {"image": IMG, "gpus": 1, **cluster}})
    rendered = render(spec, folder)
    validate_all(rendered.objects)
    (cm,) = [o for o in rendered.objects if o["kind"] == "ConfigMap"]
    return cm, rendered.warnings, to_yaml(rendered.objects)


def _shipped(cm: dict[str, Any]) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in cm.get("data", {}).items()}
    out |= {k: base64.b64decode(v) for k, v in cm.get("binaryData", {}).items()}
    return out


TUTORIAL = {
    "multigpu_torchrun.py": "import os\nimport torch\nfrom datautils import MyTrainDataset\n"
                            "from torch.utils.data import DataLoader\n\n"
                            "if __name__ == '__main__':\n    import argparse\n",
    "datautils.py": "import torch\nfrom torch.utils.data import Dataset\n\n"
                    "class MyTrainDataset(Dataset):\n    pass\n",
    "single_gpu.py": "from datautils import MyTrainDataset\n",  # beside it, imported by nobody
}


def test_the_tutorial_script_ships_the_module_it_imports(tmp_path: Path) -> None:
    folder = _write(tmp_path, TUTORIAL)
    cm, warnings, out = _render(folder, "multigpu_torchrun.py")
    assert _shipped(cm) == {name: (folder / name).read_bytes()
                            for name in ("multigpu_torchrun.py", "datautils.py")}
    assert not warnings  # torch, os, argparse: all in the image
    head = out.split("\n", 1)[0]
    assert head == ("# ConfigMap multigpu-torchrun-code -- ships: /workspace/multigpu_torchrun.py (the "
                    "script), /workspace/datautils.py (imported by multigpu_torchrun.py)")
    (pod,) = [yaml.safe_load(d) for d in out.split("---\n") if "kind: Pod" in d]
    mounts = {m["mountPath"]: m.get("subPath") for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/workspace/datautils.py"] == "datautils.py"


MINGPT = {
    "main.py": "import os\nimport torch\nfrom model import GPT\nfrom trainer import Trainer\n"
               "from char_dataset import CharDataset\nfrom omegaconf import DictConfig\n"
               "import hydra\n",
    "model.py": "import math\nfrom dataclasses import dataclass\nimport torch.nn as nn\n",
    "trainer.py": "import fsspec\nimport boto3\nimport hydra\ntry:\n    import wandb\n"
                  "except ImportError:\n    wandb = None\n",
    "char_dataset.py": "import fsspec\nimport utils\n",
    "utils.py": "import torch\n",
    "data/input.txt": "not code\n",
}


def test_imports_are_followed_transitively_and_unknown_ones_named_once(tmp_path: Path) -> None:
    folder = _write(tmp_path, MINGPT)
    cm, warnings, _ = _render(folder, "main.py")
    assert sorted(_shipped(cm)) == ["char_dataset.py", "main.py", "model.py", "trainer.py",
                                    "utils.py"]  # utils through char_dataset
    named = sorted((w.split(" imports ")[1].split(",")[0], w.split(": ")[1].split(" ")[0])
                   for w in warnings)
    # once each, with the first file importing it; fsspec comes with torch, wandb is optional
    assert named == [("boto3", "trainer.py"), ("hydra", "main.py"), ("omegaconf", "main.py")]
    assert all("ModuleNotFoundError" in w and IMG in w for w in warnings)


def test_a_package_import_ships_the_package(tmp_path: Path) -> None:
    folder = _write(tmp_path, {"train.py": "from mingpt.model import GPT\nimport disttrain\n",
                               "mingpt/__init__.py": "", "mingpt/model.py": "import torch\n",
                               "mingpt/bpe.py": "from . import model\n", "other.py": "x = 1\n"})
    cm, warnings, out = _render(folder, "train.py")
    assert sorted(_shipped(cm)) == ["mingpt____init__.py", "mingpt__bpe.py", "mingpt__model.py",
                                    "train.py"]
    assert "/workspace/mingpt/model.py (package mingpt, imported by train.py)" in out
    assert [w.split(" imports ")[1].split(",")[0] for w in warnings] == ["disttrain"]
    _, warnings, _ = _render(folder, "train.py", image_has_disttrain=True)
    assert not warnings  # the image has disttrain (and what it requires)


def test_listed_files_that_are_also_imported_ship_once(tmp_path: Path) -> None:
    folder = _write(tmp_path, TUTORIAL)
    cm, _, _ = _render(folder, "multigpu_torchrun.py", code={"files": ["datautils.py"]})
    assert sorted(_shipped(cm)) == ["datautils.py", "multigpu_torchrun.py"]


def test_run_local_does_not_warn_about_the_image(tmp_path: Path) -> None:
    folder = _write(tmp_path, MINGPT)
    spec = JobSpec.from_dict({"script": "main.py", "cluster": {"gpus": 0}})
    assert not [w for w in render(spec, folder, local=True).warnings if "imports" in w]


AWKWARD = {  # name: bytes; every one must reach the pod exactly
    "trailing_spaces.py": b"x = 1   \nprint(x)  \n",
    "tabs.py": b"def f():\n\treturn 1\t\n",
    "no_final_newline.py": b"print('end')",
    "leading_blank_line.py": b"\n\nimport os\n",
    "one_line_spaces.py": b"   ",
    "crlf.py": b"import os\r\nprint(os.sep)\r\n",
    "control_char.py": b"x = '\x1b[0m'\n",
}


def test_every_shipped_file_is_a_block_or_base64_and_exact(tmp_path: Path) -> None:
    script = "import " + ", ".join(n.removesuffix(".py") for n in AWKWARD) + "\n"
    (tmp_path / "train.py").write_text(script)
    for name, raw in AWKWARD.items():
        (tmp_path / name).write_bytes(raw)
    cm, warnings, out = _render(tmp_path, "train.py")
    (printed,) = [yaml.safe_load(d) for d in out.split("---\n") if "kind: ConfigMap" in d]
    assert printed == cm
    assert _shipped(printed) == {**AWKWARD,
                                 "train.py": script.encode()}  # round trip through PyYAML
    text, binary = set(printed.get("data", {})), set(printed.get("binaryData", {}))
    assert binary == {"crlf.py", "control_char.py"}  # what a YAML block cannot hold
    for name in text:
        assert f"\n  {name}: |" in out, name  # a literal block, never a quoted line
    notes = [w for w in warnings if "binaryData" in w]
    assert len(notes) == 2 and any("crlf.py" in n and "CRLF" in n for n in notes)
