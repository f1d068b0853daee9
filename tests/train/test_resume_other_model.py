"""`--resume` onto a checkpoint of another model (issue 25 item 5): the keys and shapes that
differ are named with the fix, exit 2, before torch's load_state_dict error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.examples.models import SimpleNet
from disttrain.train.checkpoint import save_checkpoint
from disttrain.train.ckpt_compat import state_dict_mismatch
from tests.conftest import run_cli


def test_mismatch_names_a_few_keys_of_each_kind() -> None:
    model = SimpleNet(64, 32, 10).state_dict()
    other = {**SimpleNet(64, 16, 10).state_dict(), **{f"head.{i}.weight": torch.ones(1)
                                                      for i in range(5)}}
    del other["fc2.bias"]
    problem = state_dict_mismatch(model, other)
    assert problem is not None
    assert "1 key(s) of this model missing from it (fc2.bias)" in problem
    assert "5 key(s) this model does not have (head.0.weight, head.1.weight, head.2.weight, " \
           "... (2 more))" in problem
    assert "fc1.weight: checkpoint [16, 64], model [32, 64]" in problem
    assert state_dict_mismatch(model, SimpleNet(64, 32, 10).state_dict()) is None


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_onto_another_models_checkpoint_is_bad_input(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "part" / "checkpoints"
    save_checkpoint(ckpt_dir, {"model": SimpleNet(64, 16, 10).state_dict(), "step": 3}, 3)
    res = run_cli("run", "--nproc-per-node", "2", "--master-port", "0", "--run-dir", "part",
                  "--resume", "--hidden-size", "32", "--max-steps", "1", cwd=tmp_path,
                  timeout=180)
    assert res.returncode == 2, res.stderr[-3000:]
    err = res.stderr
    assert "does not fit this model" in err and "ckpt-00000003.pt" in err
    assert "fc1.weight: checkpoint [16, 64], model [32, 64]" in err
    assert "another run dir" in err and "without --resume" in err
    assert "Traceback" not in err and "Error(s) in loading state_dict" not in err
