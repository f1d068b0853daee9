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
     "takes no argument hiden; it takes hidden"),
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


def test_file_path_references_import_the_file_by_its_stem() -> None:
    assert parse_reference("tasks/my_task.py:make") == ("my_task", "make")


_GOOD_FILE_TASK = """
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from disttrain.train.task import TrainTask

    def make_task(n: int = 4, *, scale: float = 1.0) -> TrainTask:
        data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
        return TrainTask(model=lambda: nn.Linear(3, n), train_data=data,
                         loss_fn=nn.CrossEntropyLoss(), name=f"n{n}")
"""


def test_task_files_by_absolute_and_parent_paths(task_dir: Path) -> None:
    """`/abs/path/t.py:fn` and `../x/t.py:fn` import the file with its folder on the path
    (issue 25 item 9); a missing file names where it was looked for."""
    (task_dir / "x").mkdir()
    (task_dir / "here").mkdir()
    _write(task_dir / "x", "t_task_file", _GOOD_FILE_TASK)
    by_abs = load_task(f"{task_dir}/x/t_task_file.py:make_task", {"n": 2})
    assert by_abs.model().out_features == 2 and str(task_dir / "x") in sys.path
    by_parent = load_task("../x/t_task_file.py:make_task", {"n": 3}, search=[task_dir / "here"])
    assert by_parent.name == "n3"
    with pytest.raises(TaskError, match=r"no file ../y/t_task_file.py \(looked in .*here\)"):
        load_task("../y/t_task_file.py:make_task", search=[task_dir / "here"])


@pytest.mark.parametrize(("args", "expect"), [
    ({"n": "lots"}, "task_args: n: Input should be a valid integer, unable to parse string as an "
                    "integer (got \"lots\""),
    ({"n": 2.5}, "task_args: n: Input should be a valid integer, got a number with a fractional part"),
    ({"scale": [1]}, "task_args: scale: Input should be a valid number"),
    ({"m": 1}, "takes no argument m; it takes n, scale"),
])
def test_task_args_are_checked_against_the_signature_before_the_call(task_dir: Path, args: dict,
                                                                     expect: str) -> None:
    """Validated by pydantic against the factory's annotations, without calling it: the
    checker never runs the factory, and the message names the argument."""
    from disttrain.train.task import check_task

    _write(task_dir, "t_task_typed", _GOOD_FILE_TASK.replace(
        "data = ", "raise AssertionError('called')\n        data = "))
    with pytest.raises(TaskError) as err:
        check_task("t_task_typed:make_task", args, search=[task_dir])
    assert expect in str(err.value)
    check_task("t_task_typed:make_task", {"n": "3", "scale": 2}, search=[task_dir])  # fits: no call


def test_validated_values_are_what_the_factory_gets(task_dir: Path) -> None:
    _write(task_dir, "t_task_coerce", _GOOD_FILE_TASK)
    assert load_task("t_task_coerce:make_task", {"n": "3"}, search=[task_dir]).name == "n3"


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


def test_built_in_tasks_take_their_options_as_task_args() -> None:
    """The built-in jobs are tasks like any user's: their options are their factories'
    arguments, validated the same way (issue 21 item 1)."""
    gpt = load_task("disttrain.examples.chargpt:make_task", {"layers": 2, "width": 32})
    assert gpt.name == "chargpt" and len(gpt.model().blocks) == 2
    synthetic = load_task("disttrain.examples.synthetic:make_task",
                          {"num_samples": 64, "input_size": 8, "hidden_size": 4})
    net = synthetic.model()
    assert len(synthetic.train_data) == 64 and (net.fc1.in_features, net.fc1.out_features) == (8, 4)
    with pytest.raises(TaskError, match="task_args: num_samples: Input should be greater than or equal to 8"):
        load_task("disttrain.examples.synthetic:make_task", {"num_samples": 2})
    with pytest.raises(TaskError, match="takes no argument data_dir; it takes block, layers"):
        load_task("disttrain.examples.chargpt:make_task", {"data_dir": "/x"})


def test_the_mnist_task_checks_its_files_before_launch(tmp_path: Path) -> None:
    """`check_task` runs the task's own check (task_hooks): missing IDX files are one line
    before anything starts, unless download is on."""
    from disttrain.train.task import check_task

    with pytest.raises(TaskError, match=f"MNIST IDX files not found in {tmp_path}"):
        check_task("disttrain.examples.mnist:make_task", {"data_dir": str(tmp_path)})
    check_task("disttrain.examples.mnist:make_task", {"data_dir": str(tmp_path), "download": True})
