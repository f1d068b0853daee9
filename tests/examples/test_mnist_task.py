"""examples/mnist_task.py, the guide's MNIST script as a TrainTask, trains on 2 ranks from
IDX files (written here: small, synthetic, in the real IDX format, raw and .gz)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def _fake_mnist(root: Path) -> None:
    """Images whose label is the brightest of ten 78-pixel bands: learnable, 28x28."""
    rng = np.random.default_rng(0)
    for train, n in ((True, 600), (False, 200)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 784))
        for i, label in enumerate(labels):
            images[i, label * 78:(label + 1) * 78] += 180
        prefix = "train" if train else "t10k"
        _write_idx(root / f"{prefix}-images-idx3-ubyte", images.reshape(n, 28, 28), gz=train)
        _write_idx(root / f"{prefix}-labels-idx1-ubyte", labels, gz=False)


def _train(root: str, run_dir: str) -> dict:
    with setup_for_test() as rt:
        spec = JobSpec.from_dict({}, {"task": "examples.mnist_task:make_task",
                                      "task_args": {"root": root, "hidden": 64},
                                      "task_dir": str(ROOT), "epochs": 3, "run_dir": run_dir})
        from disttrain.train.build import build_trainer

        return build_trainer(spec, rt).fit()


def test_the_guide_script_as_a_task_learns_in_sync(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    out = run_ranks(2, _train, str(tmp_path), str(tmp_path / "run"), timeout_s=180)
    assert out[0]["workload"] == "mnist" and out[0]["params_in_sync"] is True
    assert out[0]["eval"]["accuracy"] > 0.9 and out[0]["test_samples"] == 200
