"""Loaded once: a 2-rank FSDP job loading a ~270 MB model (fp32; its file in bf16, as models
are published) holds less than 1.5 copies of it in anonymous host memory, while every rank
calling `from_pretrained` holds about 2 (measured: ~0.6x against ~2.8x). Each rank ends
with its half of the parameters, and no rank ever held the whole model.

The figures come from `disttrain.recipes.host_memory.AnonPeak` (peak anonymous RSS, the
memory a pod's limit cannot reclaim); benchmarks/finetune_load_memory.py prints them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs
from tests.recipes.load_memory import measure, save_model

pytestmark = [needs("transformers"), pytest.mark.slow, pytest.mark.timeout(400)]


def test_a_pretrained_model_is_held_once_not_once_per_rank(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # set by measure(): restored after
    if not Path("/proc/self/status").is_file():
        pytest.skip("anonymous RSS is read from /proc (Linux)")
    size = save_model(tmp_path / "model", layers=4, hidden=1024)
    assert size >= 200e6
    got = measure(tmp_path / "model", "fsdp")
    assert got["recipe"] < 1.5 * size, got
    assert got["every_rank"] > 1.8 * size, got    # the contrast: a full copy in each rank
    for held in got["held_per_rank"]:            # FSDP2: each rank keeps its shard
        assert held == pytest.approx(size / 2, rel=0.02)
    for peak in got["recipe_per_rank"]:          # and never the whole model
        assert peak < size, got
