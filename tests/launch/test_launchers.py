"""Every launch method of the seeds trains the default job to the same parameters.

torchrun (`disttrain run`, the default), `--launcher spawn` (mp.spawn, seed 002),
`--launcher env` (one process per invocation from MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK,
seed 000 §5.2 way 3), and a user script taking `--world-size N --rank R` through
`disttrain.distributed.env.add_dist_args` (seed 002's verification command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.launch.ports import free_port
from tests.conftest import DISTTRAIN, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOB = ("--epochs", "1", "--max-steps", "8", "--checkpoint-every-epochs", "0",
       "--warmup-steps", "3")
SCRIPT = """
import argparse
from disttrain.distributed import runtime
from disttrain.distributed.env import add_dist_args
from disttrain.train.build import build_trainer
from disttrain.spec.job import JobSpec

parser = add_dist_args(argparse.ArgumentParser())
parser.add_argument("--run-dir")
args = parser.parse_args()
with runtime.setup_from_args(args, timeout_s=60) as rt:
    spec = JobSpec.from_dict({}, {"epochs": 1, "max_steps": 8, "checkpoint_every_epochs": 0,
                                  "warmup_steps": 3, "run_dir": args.run_dir})
    summary = build_trainer(spec, rt).fit()
print("world", rt.world_size, "rank", rt.rank, "sha", summary["params_sha256"])
"""


def _sha(run_dir: Path, preloaded: bool = False) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params_in_sync"] is True
    # Only torchrun's workers are forks of the warm fork server, which loads the data
    # once for both; the same params below show its copy is the data the others load.
    assert summary["data_preloaded"] is preloaded
    return summary["params_sha256"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.pop("DISTTRAIN_T0", None)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _pair(cmds: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    """Run one process per rank concurrently; return their outputs (all must succeed)."""
    procs = [subprocess.Popen(c, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c, e in zip(cmds, envs)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=150)
            assert p.returncode == 0, out[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module")
def shas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cwd = tmp_path_factory.mktemp("launchers")
    out: dict[str, str] = {}
    # the one job of the suite that polls for its all-reduce (tests/conftest.py blocks)
    res = run_cli("run", *JOB, "--master-port", "0", "--run-dir", "torchrun", cwd=cwd,
                  env={"DISTTRAIN_COMM_WAIT": "poll"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "lr warm-up: linear" in res.stdout and "lr 0.001 -> 0.002 (linear)" in res.stdout
    out["torchrun"] = _sha(cwd / "torchrun", preloaded=True)
    comm_wait = json.loads((cwd / "torchrun" / "summary.json").read_text())["comm_wait"]
    assert comm_wait == "poll: DISTTRAIN_COMM_WAIT=poll", comm_wait

    res = run_cli("run", *JOB, "--launcher", "spawn", "--master-port", "0", "--run-dir", "spawn",
                  cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    out["spawn"] = _sha(cwd / "spawn")

    port = str(free_port())
    envs = [_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r))
            for r in (0, 1)]
    _pair([[*DISTTRAIN, "run", *JOB, "--launcher", "env", "--run-dir", f"env{r}"] for r in (0, 1)],
          envs, cwd)
    out["env"] = _sha(cwd / "env0")
    assert not (cwd / "env1" / "summary.json").exists(), "only rank 0 writes"

    (cwd / "train.py").write_text(SCRIPT)
    port = str(free_port())
    texts = _pair([[sys.executable, "train.py", "--world-size", "2", "--rank", str(r),
                    "--master-port", port, "--run-dir", "args"] for r in (0, 1)],
                  [_env(), _env()], cwd)
    assert "world 2 rank 1" in texts[1]
    out["args"] = _sha(cwd / "args")
    return out


def test_every_launcher_gives_the_same_params(shas):
    assert len(set(shas.values())) == 1, shas


def test_spawn_launcher_refuses_scripts(tmp_path):
    (tmp_path / "t.py").write_text("print('hi')\n")
    res = run_cli("run", "t.py", "--launcher", "spawn", cwd=tmp_path, timeout=60)
    assert res.returncode == 2
    assert "--launcher spawn runs the built-in job" in res.stderr


TAKEN_AFTER_PLANNING = """
import json, socket, sys
from disttrain.launch.launchers import launch, plan_launch
from disttrain.spec.job import JobSpec

if __name__ == "__main__":   # the workers' start method imports this module
    spec = JobSpec.from_dict({"launch": {"launcher": "spawn", "nproc_per_node": 2}},
                             {"epochs": 1, "max_steps": 2, "checkpoint_every_epochs": 0,
                              "run_dir": sys.argv[1]})
    plan = plan_launch(spec)                  # the port is free now ...
    other = socket.socket()                   # ... and another job's store takes it
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("", plan.spec.launch.master_port))
    other.listen()
    result = launch(spec, plan)
    print(json.dumps({"exit_code": result.exit_code, "notes": result.notes,
                      "port": plan.spec.launch.master_port}))
"""


def test_spawn_binds_the_job_store_before_its_workers_start(tmp_path):
    """Fault: the planned port is taken between the check and the start (another job
    started meanwhile). The spawn launcher hosts the job's store itself and binds it before
    any worker starts: PortTaken, picked again, and the job trains on its own port
    (before, rank 1 connected to whatever listened there: the other job's store)."""
    (tmp_path / "taken.py").write_text(TAKEN_AFTER_PLANNING)
    res = subprocess.run([sys.executable, "taken.py", "run"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["exit_code"] == 0, res.stderr[-3000:]
    assert f"port {out['port']} was taken just before the start" in " ".join(out["notes"]), out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["params_in_sync"] is True
