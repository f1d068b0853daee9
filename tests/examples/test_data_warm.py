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


def test_the_fork_server_warms_a_built_in_task_through_its_hook(monkeypatch):
    """What forkserver_preload runs (`warm_task`): the task's warm hook loads the data the
    factory then reads, for the same task_args only; a task without a hook is not warmed."""
    from disttrain.train import task as t

    monkeypatch.setattr(t, "_warmed", set())
    ref, args = "disttrain.examples.synthetic:make_task", {"num_samples": 96, "input_size": 8}
    assert t.warm_task(ref, args) is True and t.task_warmed(ref, args)
    assert not t.task_warmed(ref, {"num_samples": 97, "input_size": 8})
    warm = data.load_dataset("synthetic", num_samples=96, input_size=8)
    assert t.load_task(ref, args).train_data.tensors[0] is warm.train_x   # the shared copy
    assert t.warm_task("disttrain.examples.chargpt:make_task", {}) is False   # no warm hook
    assert t.warm_task(ref, {"num_samples": "lots"}) is False   # bad args: the workers report
