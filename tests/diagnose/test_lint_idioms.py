"""Correct idioms of popular training code stay silent, and the misses are caught (issue 25
item 4): reduced fixtures of our own in the shape of the vision reference scripts, a
single-file GPT trainer, an Accelerate script and a torchrun script without set_device."""

from __future__ import annotations

import shutil
from pathlib import Path

from disttrain.diagnose.lint import lint_paths, lint_source

SCRIPTS = Path(__file__).parent / "scripts"

EXPECTED = {
    # prints go through the helper's rank-0 print; the loads read a Dataset and the args
    # (weights_only=True would break them: a different message), the cache holds no CUDA
    # tensors (no DT013); unscale_ and clip sit together under `if` (no DT022)
    "vision_train.py": [("DT012", 18), ("DT012", 35)],
    # backend = "nccl" in a variable with a CPU path (the miss); clip under `if grad_clip`
    "gpt_train.py": [("DT002", 21)],
    "accel_train.py": [("DT004", 21)],   # every-rank print; accelerator.print / logger silent
    "torchrun_cuda0.py": [("DT023", 11), ("DT017", 20)],
}


def found(source: str) -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in lint_source(source, "t.py")]


def test_popular_idioms_silent_and_misses_caught(tmp_path: Path) -> None:
    for name, expected in EXPECTED.items():
        findings = lint_paths([SCRIPTS / name])
        assert [(f.rule, f.line) for f in findings] == expected, name
    vision = {f.line: f for f in lint_paths([SCRIPTS / "vision_train.py"])}
    assert "dataset (a Dataset object)" in vision[18].message
    assert "args (an argparse Namespace)" in vision[35].message
    assert "weights_only=True cannot load them" in vision[35].message
    assert "add weights_only=True" not in vision[35].fix.lower()

    # the print override lives in the helper module: without it every print is named
    alone = tmp_path / "vision_train.py"
    shutil.copy(SCRIPTS / "vision_train.py", alone)
    assert [n for r, n in ((f.rule, f.line) for f in lint_paths([alone]))
            if r == "DT004"] == [17, 39, 58]
    (tmp_path / "vision_utils.py").write_text((SCRIPTS / "vision_utils.py").read_text())
    assert "DT004" not in {f.rule for f in lint_paths([alone])}

    # without unscale_ the clip is named, citing the backward's line (not its loop's)
    gpt = (SCRIPTS / "gpt_train.py").read_text()
    without = gpt.replace("        scaler.unscale_(optimizer)\n", "")
    (hit,) = [f for f in lint_source(without, "g.py") if f.rule == "DT022"]
    assert "line 45)" in hit.message and hit.line == 47

    # the wrapper saved from another method of the class that wrapped it
    cls = ("import torch\nimport torch.distributed as dist\n"
           "from torch.nn.parallel import DistributedDataParallel as DDP\n"
           "class Trainer:\n    def __init__(self, model, rank):\n"
           "        self.model = DDP(model, device_ids=[rank])\n"
           "    def save(self):\n        torch.save(self.model.state_dict(), 'c.pt')\n"
           "    def save_right(self):\n        torch.save(self.model.module.state_dict(), 'c.pt')\n")
    assert [r for r, _ in found(cls)].count("DT017") == 1
