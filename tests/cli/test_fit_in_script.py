"""`disttrain.fit()` inside a script started by `disttrain run SCRIPT` writes into the run
directory that command made for the attempt (issue 25 item 8), beside the ranks' logs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from disttrain.launch.plan import worker_env
from disttrain.spec.job import JobSpec
from tests.conftest import run_cli

SCRIPT = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import disttrain

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x.sum(1) > 0).long())
    task = disttrain.TrainTask(model=lambda: nn.Linear(4, 2), train_data=data, loss_fn=nn.CrossEntropyLoss())
    disttrain.fit(task, disttrain.JobSpec(train={"epochs": 1, "checkpoint_every_epochs": 0}))
''')


def test_a_script_run_tells_its_ranks_the_run_dir() -> None:
    spec = JobSpec(script="fit_me.py", train={"run_dir": "runs/fit_me/run-3"})
    assert worker_env(spec, 1)["DISTTRAIN_RUN_DIR"] == str(Path("runs/fit_me/run-3").resolve())
    assert "DISTTRAIN_RUN_DIR" not in worker_env(JobSpec(), 1)  # a task's run dir is its spec's


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fit_in_a_script_writes_into_the_attempt_run_dir(tmp_path: Path) -> None:
    (tmp_path / "fit_me.py").write_text(SCRIPT)
    res = run_cli("run", "fit_me.py", "--nproc-per-node", "1", "--master-port", "0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    attempt = tmp_path / "runs" / "fit_me" / "run-1"
    summary = json.loads((attempt / "summary.json").read_text())
    assert summary["steps"] == 2 and (attempt / "logs").is_dir() and (attempt / "metrics.jsonl").exists()
    assert not (tmp_path / "runs" / "disttrain").exists()  # not fit()'s default run dir
