"""The warm fork server's dataset copy (`data.warm_dataset`): the same data a worker would
load itself, served only for the same arguments, and never a download."""

from __future__ import annotations

import pytest
import torch

from disttrain.examples import datasets as data


@pytest.fixture(autouse=True)
def no_warm_data():
    data._warm.clear()
    yield
    data._warm.clear()


def test_warm_copy_is_served_for_the_same_arguments_only():
    assert data.warm_dataset("synthetic", num_samples=500, input_size=16) is True
    warm = data.load_dataset("synthetic", num_samples=500, input_size=16)
    assert data.is_warm(warm)
    assert data.load_dataset("synthetic", num_samples=500, input_size=16) is warm
    other = data.load_dataset("synthetic", num_samples=400, input_size=16)
    assert not data.is_warm(other) and len(other.train_x) == 400


def test_warm_copy_equals_a_fresh_load():
    data.warm_dataset("synthetic", num_samples=500, input_size=16)
    warm = data.load_dataset("synthetic", num_samples=500, input_size=16)
    data._warm.clear()
    fresh = data.load_dataset("synthetic", num_samples=500, input_size=16)
    assert not data.is_warm(fresh)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(warm, name), getattr(fresh, name)), name


def test_missing_files_are_not_warmed_and_not_downloaded(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("warm_dataset must never download")

    monkeypatch.setattr(data, "download_mnist", no_network)
    assert data.warm_dataset("mnist", data_dir=str(tmp_path)) is False
    assert data._warm == {}
    with pytest.raises(data.DatasetError, match="IDX files"):
        data.load_dataset("mnist", data_dir=str(tmp_path))
