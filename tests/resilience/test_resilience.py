"""Fault tolerance end to end: killed and stalled workers, damaged checkpoints (docs/resilience.md).

Faults come from the test-only hook `DISTTRAIN_FAULT` (disttrain.resilience.watchdog): the worker of
the given rank SIGKILLs or SIGSTOPs itself at the given optimizer step and phase, in the
first round only, so the restarted round runs clean.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REFERENCE_JOB, REFERENCE_STEPS, copy_run, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("no_stray_workers")]

# 2 epochs of digits on 2 ranks = 46 optimizer steps (23 per epoch); checkpoints at
# steps 10, 20, 23 (epoch end), 30, 40, 46; the newest two are kept.
COMMON = REFERENCE_JOB
STEPS = REFERENCE_STEPS
RANDOM_STEP = random.Random(int.from_bytes(os.urandom(4), "little")).randrange(2, STEPS)
# One job goes through these failures one after the other, each in its own restart round
# (`restart=N`), each round resuming from what the rounds before it left: a lost worker
# before the first checkpoint, just before and right after one, in the epoch-end
# evaluation, rank 0 killed inside its save, then a stalled worker found by the watchdog.
# One launch instead of six (the suite's time, issue 21 item 6); a failure names the chain.
CHAIN = [
    ("before-the-first-checkpoint", "kill:rank=1:step=1"),
    ("just-before-checkpoint-20", "kill:rank=1:step=19"),
    ("right-after-checkpoint-20", "kill:rank=1:step=20"),
    ("in-the-epoch-end-eval", "kill:rank=1:step=23:phase=eval"),
    ("rank0-in-its-save", "kill:rank=0:step=30:phase=checkpoint"),
    ("stalled-then-restarted", "stop:rank=1:step=33:phase=backward"),
]
CHAINED = ",".join(f"{fault}:restart={i}" for i, (_, fault) in enumerate(CHAIN))
KILL_POINTS = [
    # --timeout-s 10: every round of the chain is watched, restarted ones included, on a
    # machine the other test worker loads (a slow restart must not look like a stall)
    pytest.param(CHAINED, ("--max-restarts", str(len(CHAIN)), "--timeout-s", "10"),
                 len(CHAIN), id="six-faults-in-a-row"),
    # the id stays the same in every session (pytest-xdist's workers must collect alike);
    # the step drawn is in the fault string each failure message shows
    pytest.param("kill:rank=1:step=RANDOM", ("--max-restarts", "1"), 1, id="random-step"),
]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(digits_reference) -> str:
    """params_sha256 of the run that never failed (the session's one, conftest.py)."""
    return _summary(digits_reference)["params_sha256"]


@pytest.mark.parametrize(("fault", "extra", "fired"), KILL_POINTS)
def test_lost_worker_restarts_and_finishes_bitwise_exact(tmp_path, reference, fault, extra, fired):
    fault = fault.replace("RANDOM", str(RANDOM_STEP))
    res = run_cli(*COMMON, "--run-dir", "run", *extra, cwd=tmp_path,
                  env={"DISTTRAIN_FAULT": fault})
    out = res.stdout + res.stderr
    assert out.count("disttrain fault injection") == fired, f"{fault}: not every fault fired\n{out[-4000:]}"
    assert res.returncode == 0, out[-4000:]
    summary = _summary(tmp_path / "run")
    assert summary["steps"] == STEPS and summary["params_in_sync"] is True
    assert summary["params_sha256"] == reference, f"{fault}: not bitwise equal to the reference"
    train = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    keys = [(r["rank"], r["step"]) for r in train]
    assert len(keys) == len(set(keys)), "records of the lost round must not be kept twice"


def test_stalled_worker_ends_the_job_within_the_timeout_naming_it(tmp_path):
    timeout_s = 6
    res = run_cli("run", "--nproc-per-node", "2", "--epochs", "2", "--master-port", "0",
                  "--timeout-s", str(timeout_s),
                  cwd=tmp_path, env={"DISTTRAIN_FAULT": "stop:rank=1:step=17:phase=backward"},
                  timeout=180)
    ended = time.time()
    stalled = re.search(r"fault injection .* stop rank 1 pid (\d+) .* t=([\d.]+)", res.stderr)
    assert stalled, res.stderr[-3000:]
    pid, stall_to_exit = int(stalled.group(1)), ended - float(stalled.group(2))
    assert res.returncode == 1, res.stderr[-3000:]
    named = re.search(rf"error: rank 1 \(pid {pid}, host \S+\) made no progress for (\d+) s; "
                      rf"last seen: step 17, phase backward", res.stderr)
    assert named and int(named.group(1)) >= timeout_s, res.stderr[-3000:]
    failed = re.search(r"failed rank\(s\): ([\d, ]+)", res.stderr)
    assert failed and "1" in failed.group(1).split(", "), res.stderr[-3000:]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    print(f"\nstall -> exit: {stall_to_exit:.1f} s (timeout {timeout_s} s)")
    # The bound of the issue is the timeout; what is added is detection (one poll),
    # torchrun's teardown and interpreter exit, slow on this shared 2-core machine.
    assert stall_to_exit < timeout_s + 30


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, reference, digits_part):
    copy_run(digits_part, tmp_path / "run")  # the session's run cut at step 30 (conftest.py)
    newest = tmp_path / "run" / "checkpoints" / "ckpt-00000030.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit inside the tensor data
    newest.write_bytes(bytes(data))
    rest = run_cli(*COMMON, "--run-dir", "run", "--resume", cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "skipping checkpoint" in rest.stderr and "ckpt-00000030.pt: corrupt" in rest.stderr
    assert "resumed from run/checkpoints/ckpt-00000023.pt (epoch 1, step 23)" in rest.stdout
    assert _summary(tmp_path / "run")["params_sha256"] == reference


def _resume_from_private_dirs(base: str) -> str:
    """Each rank has its own run dir (as pods without a shared volume would): only rank
    0's holds the checkpoint."""
    from disttrain.spec.job import JobSpec
    from disttrain.testing import setup_for_test
    from disttrain.train.build import build_trainer

    with setup_for_test() as rt:
        overrides = {"epochs": 1, "max_steps": 5, "checkpoint_every_steps": 5,
                     "run_dir": str(Path(base) / f"node{rt.rank}")}
        build_trainer(JobSpec.from_dict({}, overrides), rt).fit()
        again = build_trainer(JobSpec.from_dict({}, {**overrides, "resume": True}), rt)
        try:
            again.maybe_resume()
        except RuntimeError as exc:
            return str(exc)
        return "resumed"


def test_ranks_that_see_different_checkpoints_refuse_to_resume(tmp_path):
    from disttrain.testing import run_ranks

    results = run_ranks(2, _resume_from_private_dirs, str(tmp_path), timeout_s=120)
    for message in results.values():
        assert "the ranks found different checkpoints" in message
        assert "step by rank: [5, None]" in message and "shares" in message


PORT_RACE = """
import socket, sys
import disttrain.launch.plan as plan

if __name__ == "__main__":
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    plan.choose_port = lambda spec: (port, None)  # free when checked, taken when bound
    from disttrain.cli.main import main

    sys.exit(main(["run", "--epochs", "1", "--checkpoint-every-epochs", "0"]))
"""


def test_port_taken_between_check_and_bind_is_picked_again(tmp_path):
    import subprocess
    import sys

    (tmp_path / "race.py").write_text(PORT_RACE)
    res = subprocess.run([sys.executable, "race.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "was taken just before the start; using free port" in res.stderr
    assert _summary(tmp_path / "runs" / "disttrain")["params_in_sync"] is True
