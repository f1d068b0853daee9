"""TrainTask and `module:function` references: every bad task gets one clear TaskError."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from disttrain.errors import SpecError
from disttrain.examples.chargpt import CharGPT, CharWindows, bigram_nats, encode, lm_step
from disttrain.train.task import TaskError, TrainTask, load_task, parse_reference

DATA = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))


def _write(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


@pytest.fixture
def task_dir(tmp_path: Path):
    before = list(sys.path)
    yield tmp_path
    sys.path[:] = before
    for mod in [m for m in sys.modules if m.startswith("t_task_")]:
        del sys.modules[mod]


def test_a_good_task_loads_with_its_arguments(task_dir: Path) -> None:
    _write(task_dir, "t_task_good", """
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from disttrain.train.task import TrainTask

        def make_task(hidden: int = 4) -> TrainTask:
            data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
            return TrainTask(model=lambda: nn.Linear(3, hidden), train_data=data,
                             loss_fn=nn.CrossEntropyLoss())
    """)
    task = load_task("t_task_good:make_task", {"hidden": 2}, search=[task_dir])
    assert isinstance(task, TrainTask) and task.name == "make_task"
    assert task.model().out_features == 2


@pytest.mark.parametrize(("body", "ref", "args", "expect"), [
    ("", "t_task_missing_mod:make", {}, "no module 't_task_missing_mod'"),
    ("def other(): pass\n", "t_task_noattr:make_task", {}, "has no 'make_task'; its functions: other"),
    ("make_task = 3\n", "t_task_notfn:make_task", {}, "is a int, not a function"),
    ("def make_task():\n    raise RuntimeError('no /data here')\n", "t_task_raises:make_task", {},
     "raised RuntimeError: no /data here"),
    ("def make_task():\n    return {'model': 1}\n", "t_task_wrongtype:make_task", {},
     "returned dict, not a disttrain.TrainTask"),
    ("def make_task(hidden=1):\n    pass\n", "t_task_badarg:make_task", {"hiden": 2},
     "takes no argument(s) hiden; it takes hidden"),
    ("import not_a_real_package_xyz\ndef make_task(): pass\n", "t_task_dep:make_task", {},
     "imports 'not_a_real_package_xyz', which is not installed"),
    ("def make_task(:\n", "t_task_syntax:make_task", {}, "t_task_syntax.py:1"),
])
def test_bad_references_name_the_problem(task_dir: Path, body: str, ref: str, args: dict,
                                         expect: str) -> None:
    if body:
        _write(task_dir, ref.split(":")[0], body)
    with pytest.raises(TaskError) as err:
        load_task(ref, args, search=[task_dir])
    assert expect in str(err.value)
    assert isinstance(err.value, SpecError)   # the CLI's exit 2


@pytest.mark.parametrize("ref", ["nocolon", "mod:", ":fn", "mod:not-an-id", "1mod:fn"])
def test_malformed_references(ref: str) -> None:
    with pytest.raises(TaskError, match="module"):
        parse_reference(ref)


def test_file_path_references_become_module_names() -> None:
    assert parse_reference("tasks/my_task.py:make") == ("tasks.my_task", "make")


@pytest.mark.parametrize(("kwargs", "expect"), [
    ({"model": 3, "train_data": DATA, "loss_fn": nn.MSELoss()}, "model must be an nn.Module"),
    ({"model": nn.Linear(3, 2), "train_data": [1, 2], "loss_fn": nn.MSELoss()}, None),
    ({"model": nn.Linear(3, 2), "train_data": 5, "loss_fn": nn.MSELoss()}, "train_data must be a torch"),
    ({"model": nn.Linear(3, 2), "train_data": TensorDataset(torch.zeros(0, 3)), "loss_fn": nn.MSELoss()},
     "train_data has length 0"),
    ({"model": nn.Linear(3, 2), "train_data": DATA}, "give loss_fn"),
    ({"model": nn.Linear(3, 2), "train_data": DATA, "loss_fn": nn.MSELoss(), "step_fn": lm_step},
     "not both"),
    ({"model": nn.Linear(3, 2), "train_data": DATA, "loss_fn": nn.MSELoss(), "metrics": {"loss": len}},
     "metric name 'loss'"),
    ({"model": nn.Linear(3, 2), "train_data": DATA, "loss_fn": nn.MSELoss(), "fsdp_block": int},
     "fsdp_block must be an nn.Module subclass"),
])
def test_task_fields_are_checked(kwargs: dict, expect: str | None) -> None:
    if expect is None:
        TrainTask(**kwargs)   # a plain list is a valid map-style dataset
        return
    with pytest.raises(TaskError, match=expect):
        TrainTask(**kwargs)


def test_chargpt_windows_and_model_shapes() -> None:
    codes, vocab = encode("abcabcabcabc")
    windows = CharWindows(codes, block=4, stride=4)
    assert len(windows) == 2
    x, y = windows[1]
    assert torch.equal(x[1:], y[:-1]) and x.shape == (4,)
    model = CharGPT(len(vocab), block=4, layers=1, width=8, heads=2)
    loss = lm_step(model, (x[None], y[None]))
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(3.0)).item()) < 0.5


def test_bigram_bound_is_exact_on_a_known_text() -> None:
    # "abab": a->b always, b->a always: a perfect bigram model, 0 nats
    assert bigram_nats("ababab") == pytest.approx(0.0)
    # two equally likely successors of every 'a': log 2 for half the pairs
    assert bigram_nats("aabab" * 200) > 0.0
