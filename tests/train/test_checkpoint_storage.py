"""Storage faults end to end: a run dir that fills up during a checkpoint, a damaged newest
checkpoint; each then resumed to the params_sha256 of a run that never met the fault
(docs/resilience.md, "Storage faults")."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import DISTTRAIN, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("no_stray_workers")]

# digits on 2 ranks, 4 optimizer steps, checkpoints at steps 2 and 4 (~490 KB each)
COMMON = ("run", "--nproc-per-node", "2", "--max-steps", "4", "--checkpoint-every-steps", "2",
          "--master-port", "0")


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """The run that never met a fault; its checkpoints (steps 2 and 4) are the ones the
    damage tests break."""
    cwd = tmp_path_factory.mktemp("reference")
    res = run_cli(*COMMON, "--run-dir", "ref", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _summary(cwd / "ref")["steps"] == 4
    return cwd / "ref"


@pytest.fixture(scope="module")
def reference(reference_run) -> str:
    return _summary(reference_run)["params_sha256"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_checkpoint_falls_back_and_resumes_bitwise(tmp_path, reference_run,
                                                                   reference, damage):
    shutil.copytree(reference_run, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "ckpt-00000004.pt"
    (tmp_path / "run" / "checkpoints" / "last.pt").unlink()  # its own inode after the copy
    data = bytearray(newest.read_bytes())
    size = len(data)
    if damage == "truncate":
        data = data[: size // 2]
    else:
        data[size // 3] ^= 0x04  # one bit
    newest.write_bytes(bytes(data))
    again = run_cli(*COMMON, "--run-dir", "run", "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    warnings = [line for line in again.stderr.splitlines() if "skipping checkpoint" in line]
    what = f"truncated ({size // 2} bytes, its manifest records {size})" if damage == "truncate" \
        else "corrupt (its sha256 differs from the one ckpt-00000004.manifest.json records)"
    assert len(warnings) == 1 and f"ckpt-00000004.pt: {what}" in warnings[0], again.stderr[-3000:]
    assert "resumed from run/checkpoints/ckpt-00000002.pt (epoch 0, step 2)" in again.stdout
    assert _summary(tmp_path / "run")["params_sha256"] == reference


# The run dir on a tmpfs of 768 KiB: job.yaml, metrics and the step-2 checkpoint fit, the
# step-4 one does not. It is mounted in a private mount namespace (nothing outside sees it),
# then grown ("freeing space") for the resumed run; what the test reads is copied out.
SCRIPT = """
set -u
mount -t tmpfs -o size=768k tmpfs disk || exit 90
cd disk
{run} --run-dir run > ../first.out 2> ../first.err
echo $? > ../first.rc
cp -a run/checkpoints ../after-fault
mount -o remount,size=8m tmpfs . || exit 91
{run} --run-dir run --resume > ../again.out 2> ../again.err
echo $? > ../again.rc
cp run/summary.json ../summary.json
"""


def test_disk_full_during_a_checkpoint_is_one_clear_error_and_resumable(tmp_path, reference):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    (tmp_path / "disk").mkdir()
    run = shlex.join([*DISTTRAIN, *COMMON])
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           SCRIPT.format(run=run)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=280, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode in (90, 91) or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-300:]}")
    first_err = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first_err[-3000:]
    errors = [line for line in first_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, first_err[-3000:]
    assert "Traceback" not in first_err, first_err[-3000:]
    assert "run/checkpoints/ckpt-00000004.pt: no space left on device: it needs about " in errors[0]
    needed = int(errors[0].split("needs about ")[1].split()[0])
    free = int(errors[0].split(" bytes, ")[1].split()[0])
    assert free < needed < 768 * 1024, errors[0]

    from disttrain.train.checkpoint import list_checkpoints, load_checkpoint

    left = tmp_path / "after-fault"
    assert [p.name for p in list_checkpoints(left)] == ["ckpt-00000002.pt"]
    assert not [p.name for p in left.iterdir() if p.name.endswith(".tmp")], "a partial file is left"
    assert load_checkpoint(left / "ckpt-00000002.pt")["step"] == 2  # complete, manifest checked

    again_err = (tmp_path / "again.err").read_text()
    assert (tmp_path / "again.rc").read_text().strip() == "0", again_err[-3000:]
    assert "resumed from run/checkpoints/ckpt-00000002.pt" in (tmp_path / "again.out").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == reference
