"""`disttrain run --example chargpt` with its defaults (2 processes, batch 32, lr 1e-3
linearly scaled) but 4 of its 10 epochs learns more than any character bigram can: its
held-out loss ends below a bigram fitted and scored on the whole text (computed here,
since the text differs between Python versions). Measured on this machine: 2.21 nats
after 4 epochs and 1.72 after all 10, against the bigram's 2.46; the whole default run
(about a minute and a half on two quiet cores) is `disttrain run --example chargpt`."""

from __future__ import annotations

import json

import pytest

from disttrain.examples.chargpt import bigram_nats, load_text
from tests.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EPOCHS = 4


def test_chargpt_beats_the_bigram_bound_in_four_epochs(tmp_path):
    run_dir = tmp_path / "chargpt"
    res = run_cli("run", "--example", "chargpt", "--epochs", str(EPOCHS), "--master-port", "0",
                  "--run-dir", str(run_dir), cwd=tmp_path, timeout=540)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workload"] == "chargpt" and summary["world_size"] == 2
    assert summary["epochs"] == EPOCHS and summary["params_in_sync"] is True
    bound = bigram_nats(load_text())
    assert summary["eval"]["loss"] < bound - 0.15, (summary["eval"], bound)
