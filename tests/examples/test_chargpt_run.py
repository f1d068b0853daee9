"""`disttrain run --example chargpt` with every default (2 processes, 10 epochs, batch 32,
lr 1e-3 linearly scaled) learns more than any character bigram can: its held-out loss
ends well below a bigram fitted and scored on the whole text (computed here, since the
text differs between Python versions). About a minute on two quiet CPU cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disttrain.examples.chargpt import bigram_nats, load_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_chargpt_defaults_beat_the_bigram_bound(tmp_path):
    run_dir = tmp_path / "chargpt"
    res = subprocess.run([sys.executable, "-m", "disttrain.cli.main", "run", "--example", "chargpt",
                          "--master-port", "0", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workload"] == "chargpt" and summary["world_size"] == 2
    assert summary["epochs"] == 10 and summary["params_in_sync"] is True
    bound = bigram_nats(load_text())
    assert summary["eval"]["loss"] < bound - 0.5, (summary["eval"], bound)
