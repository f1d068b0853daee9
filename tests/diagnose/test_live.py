"""Real processes: the rules hold on what this machine's torch prints today.

The fixtures in logs/ were captured once; these tests capture again, so a torch upgrade
that rewords a message fails here instead of silently turning a diagnosis into `unknown`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import run_cli

from disttrain.diagnose.lint import lint_paths
from disttrain.diagnose.logs import diagnose

HERE = Path(__file__).parent
REPRO = HERE / "logs" / "repro"


def torchrun(script: Path, cwd: Path, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    # TMPDIR: plain torchrun leaves a torchelastic_* folder in it per launch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(cwd),
           **(extra_env or {})}
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def test_diagnose_and_lint_do_not_import_torch() -> None:
    code = ("import sys, disttrain.diagnose.logs, disttrain.diagnose.lint, "
            "disttrain.diagnose.preflight, disttrain.diagnose.envreport, "
            "disttrain.cli.doctor_cmd, disttrain.cli.lint_cmd, disttrain.cli.env_cmd; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_live_user_error_names_rank_1(tmp_path: Path) -> None:
    code, log = torchrun(REPRO / "user_error.py", tmp_path)
    assert code != 0
    d = diagnose(log)
    assert (d.cause, d.rank) == ("user_code_error", 1), log[-3000:]
    assert "ValueError" in d.title


@pytest.mark.slow
def test_live_unused_parameters(tmp_path: Path) -> None:
    code, log = torchrun(REPRO / "unused.py", tmp_path)
    assert code != 0
    assert diagnose(log).cause == "unused_parameters", log[-3000:]


@pytest.mark.slow
def test_clean_script_lints_clean_and_runs(tmp_path: Path) -> None:
    """Run as a user runs their script with disttrain, whose ranks end without the
    interpreter's teardown: under plain torchrun a rank of this script that had printed
    "training done" and destroyed its group was once ended by torch's teardown abort
    (`terminate called without an active exception`, SIGABRT; pytorch/pytorch#190489,
    docs/resilience.md "How a process ends"), which no script can prevent."""
    script = HERE / "scripts" / "clean_ddp.py"
    assert lint_paths([script]) == []
    res = run_cli("run", str(script), "--nproc-per-node", "2", "--master-port", "0",
                  cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "CHECKPOINT": str(tmp_path / "ck.pt")})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert "training done" in log and diagnose(log).cause == "none", log[-3000:]
