"""The Trainer's guarantees for a user's own TrainTask, on real 2-rank gloo groups.

Tasks here are module-level functions (run_ranks pickles them into forked ranks). Each
test asserts one guarantee of docs/your-model.md: any batch structure, the fast and the
DataLoader path give the same training, exact mid-epoch resume, IterableDataset shards
of different lengths stop together, each eval sample counted once, buffers in sync.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset, get_worker_info

from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test
from disttrain.train.build import build_trainer
from disttrain.train.task import TaskError, TrainTask

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

G = torch.Generator().manual_seed(7)
X = torch.randn(203, 6, generator=G)
Y = (X @ torch.randn(6, 3, generator=G)).argmax(1)


class DictData(Dataset):
    """Samples as dicts: no (input, target) pair, so it needs a step_fn."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": X[i], "label": Y[i]}


class PairData(Dataset):
    """The same samples as TensorDataset(X, Y), through __getitem__ (the DataLoader path)."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return X[i], Y[i]


class UnevenStream(IterableDataset):
    """Rank r yields 40 + 13 r samples: shards of different lengths."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        assert get_worker_info() is None
        for i in range(self.pos, 40 + 13 * rank):
            yield X[i], Y[i]


def seen_metric(outputs, batch):
    """(samples in the batch, 1): summed over ranks, samples seen / eval batches run."""
    return torch.tensor(float(len(batch[1]))), 1


def dict_step(model, batch):
    out = model(batch["features"])
    return nn.functional.cross_entropy(out, batch["label"]), out


def accuracy(outputs, batch):
    target = batch["label"] if isinstance(batch, dict) else batch[1]
    return (outputs.argmax(1) == target).sum(), len(target)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def make_bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _fit(task: TrainTask, run_dir: str, **overrides) -> dict:
    with setup_for_test() as rt:
        spec = JobSpec.from_dict({}, {"epochs": 2, "batch_size": 16, "run_dir": run_dir,
                                      "checkpoint_every_epochs": 0, **overrides})
        return build_trainer(spec, rt, task).fit()


def _dict_task(run_dir: str) -> dict:
    task = TrainTask(model=make_net, train_data=DictData(), eval_data=DictData(),
                     step_fn=dict_step, metrics={"accuracy": accuracy}, name="dicts")
    return _fit(task, run_dir, epochs=8, lr=0.01)


def test_any_batch_structure_trains_in_sync(tmp_path: Path) -> None:
    out = run_ranks(2, _dict_task, str(tmp_path / "run"), timeout_s=180)
    for summary in out.values():
        assert summary["params_in_sync"] is True
        assert summary["eval"]["accuracy"] > 0.8 and summary["test_accuracy"] == summary["eval"]["accuracy"]
        assert summary["workload"] == "dicts"
    assert (tmp_path / "run" / "summary.json").is_file()


def _pair_task(run_dir: str, fast: bool) -> str:
    data = TensorDataset(X, Y) if fast else PairData()
    task = TrainTask(model=make_net, train_data=data, loss_fn=nn.CrossEntropyLoss())
    return _fit(task, run_dir, num_workers=0 if fast else 1)["params_sha256"]


def _both_paths(base: str) -> tuple[str, str]:
    # one spawn: the two fits run one after the other in the same ranks, each in its own
    # process group (setup_for_test), as two spawns would (the suite's time, issue 21)
    return _pair_task(f"{base}/fast", True), _pair_task(f"{base}/slow", False)


def test_dataloader_path_trains_exactly_like_the_tensor_path(tmp_path: Path) -> None:
    out = run_ranks(2, _both_paths, str(tmp_path), timeout_s=240)
    fast, slow = zip(*(out[rank] for rank in (0, 1)), strict=True)
    assert fast[0] == fast[1] == slow[0] == slow[1]


def _resumable(run_dir: str, stop_at: int | None, resume: bool) -> str:
    task = TrainTask(model=make_net, train_data=DictData(), step_fn=dict_step)
    extra = {"max_steps": stop_at} if stop_at else {}
    return _fit(task, run_dir, checkpoint_every_steps=1, resume=resume, epochs=3,
                **extra)["params_sha256"]


def _whole_then_stopped(base: str) -> str:
    """The uninterrupted run, then the run stopped at step 9, in the same ranks (one spawn);
    the resume runs in fresh processes, so nothing in memory carries over to it."""
    whole = _resumable(f"{base}/a", None, False)
    _resumable(f"{base}/b", 9, False)   # 7 steps/epoch
    return whole


def test_resume_in_the_middle_of_an_epoch_is_exact(tmp_path: Path) -> None:
    whole = run_ranks(2, _whole_then_stopped, str(tmp_path), timeout_s=240)
    resumed = run_ranks(2, _resumable, str(tmp_path / "b"), None, True, timeout_s=180)
    assert resumed[0] == resumed[1] == whole[0]


def _stream_task(run_dir: str) -> dict:
    task = TrainTask(model=make_net, train_data=UnevenStream(), loss_fn=nn.CrossEntropyLoss())
    return _fit(task, run_dir, epochs=1)


def test_uneven_stream_shards_stop_together(tmp_path: Path) -> None:
    out = run_ranks(2, _stream_task, str(tmp_path / "s"), timeout_s=120)
    # rank 0 has 40 samples = 3 batches of 16: both ranks take exactly 3 steps, none hangs
    assert out[0]["steps"] == out[1]["steps"] == 3
    assert out[0]["params_in_sync"] is True


def _eval_count(run_dir: str) -> dict:
    task = TrainTask(model=make_net, train_data=TensorDataset(X, Y),
                     eval_data=PairData(), loss_fn=nn.CrossEntropyLoss(),
                     metrics={"samples": seen_metric})
    return _fit(task, run_dir, epochs=1)


def test_each_eval_sample_is_counted_once(tmp_path: Path) -> None:
    out = run_ranks(2, _eval_count, str(tmp_path / "e"), timeout_s=120)
    # 203 samples on 2 ranks: DistributedSampler would pad to 204; the eval split does not.
    # seen_metric's sum is the batch sizes, its count the batches: 102 + 101 over 2 + 2 batches
    # (eval batches hold 1024), so sum / count = 203 / 2.
    assert out[0]["eval"]["samples"] == pytest.approx(203 / 2)


def _bn_task(run_dir: str, strategy: str) -> dict:
    task = TrainTask(model=make_bn_net, train_data=PairData(), loss_fn=nn.CrossEntropyLoss())
    return _fit(task, run_dir, strategy=strategy, epochs=1)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_batchnorm_statistics_end_in_sync(tmp_path: Path, strategy: str) -> None:
    out = run_ranks(2, _bn_task, str(tmp_path / strategy), strategy, timeout_s=180)
    assert out[0]["params_in_sync"] is True and out[1]["params_in_sync"] is True


def _bad_loss(run_dir: str) -> str:
    task = TrainTask(model=make_net, train_data=PairData(),
                     loss_fn=nn.CrossEntropyLoss(reduction="none"))
    try:
        _fit(task, run_dir, epochs=1)
    except TaskError as exc:
        return str(exc)
    return "no error"


def test_a_non_scalar_loss_is_named(tmp_path: Path) -> None:
    out = run_ranks(1, _bad_loss, str(tmp_path / "bad"), timeout_s=60)
    assert "loss_fn must return a scalar loss tensor, got shape (16,)" in out[0]


FIT_SCRIPT = """
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset
import disttrain

g = torch.Generator().manual_seed(0)
x = torch.randn(128, 4, generator=g)
y = (x.sum(1) > 0).long()
task = disttrain.TrainTask(model=lambda: nn.Linear(4, 2), train_data=TensorDataset(x, y),
                           eval_data=TensorDataset(x, y), loss_fn=nn.CrossEntropyLoss())
spec = disttrain.JobSpec.from_dict({}, {"epochs": 3, "run_dir": "out", "lr": 0.05})
summary = disttrain.fit(task, spec)
# one line, one write(2): print writes each piece, separator and end on its own, and the
# two ranks share torchrun's stdout ("RANKRANK 0 True ..." and "RANK 0 True 0.23RANK 1 ..."
# were seen)
line = f"RANK {summary['rank']} {summary['params_in_sync']} {round(summary['eval']['loss'], 6)}"
sys.stdout.flush()
os.write(1, (line + "\\n").encode())
"""


def test_fit_under_plain_torchrun(tmp_path: Path) -> None:
    import subprocess
    import sys

    from disttrain.launch.ports import free_port

    (tmp_path / "train.py").write_text(FIT_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", "train.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TMPDIR": str(tmp_path)})   # torchrun's folder
    assert out.returncode == 0, out.stderr[-3000:]
    # found anywhere in a line: both ranks write to torchrun's one stdout (each rank's
    # line is one write; disttrain's own output may still end up around it)
    ranks = sorted(re.findall(r"RANK (\d) (True|False) ([0-9.]+)", out.stdout))
    assert [r[:2] for r in ranks] == [("0", "True"), ("1", "True")], out.stdout[-3000:]
    assert ranks[0][2] == ranks[1][2]   # the same eval loss on both ranks
    assert (tmp_path / "out" / "summary.json").is_file()


class CountingStream(IterableDataset):
    """A stream with its own position (state_dict / load_state_dict): each rank reads its
    own slice of X; `resumable=False` drops the methods, so the Trainer must replay."""

    def __init__(self, resumable: bool) -> None:
        self.pos = 0
        if not resumable:
            self.state_dict = None       # type: ignore[assignment]
            self.load_state_dict = None  # type: ignore[assignment]

    def set_epoch(self, epoch: int) -> None:
        self.pos = 0

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        shard = torch.arange(rank, len(X), 2)
        while self.pos < len(shard):
            i = int(shard[self.pos])
            self.pos += 1
            yield X[i], Y[i]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


def _stream_resume(run_dir: str, resumable: bool, stop_at: int | None,
                   resume: bool) -> tuple[str, bool]:
    import contextlib
    import io

    task = TrainTask(model=make_net, train_data=CountingStream(resumable),
                     loss_fn=nn.CrossEntropyLoss())
    extra = {"max_steps": stop_at} if stop_at else {}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sha = _fit(task, run_dir, epochs=2, checkpoint_every_steps=1, resume=resume,
                   **extra)["params_sha256"]
    return sha, "replaying 5 batches" in err.getvalue()


STREAM_KINDS = {"state_dict": True, "replayed": False}


def _streams_whole_then_stopped(base: str) -> dict[str, str]:
    """Both kinds of stream, uninterrupted and stopped at step 5, in the same ranks (one
    spawn, each fit its own process group); the resumes run in fresh processes."""
    whole = {}
    for kind, resumable in STREAM_KINDS.items():
        whole[kind] = _stream_resume(f"{base}/{kind}/a", resumable, None, False)[0]
        _stream_resume(f"{base}/{kind}/b", resumable, 5, False)
    return whole


def _streams_resumed(base: str) -> dict[str, tuple[str, bool]]:
    return {kind: _stream_resume(f"{base}/{kind}/b", resumable, None, True)
            for kind, resumable in STREAM_KINDS.items()}


def test_a_stream_resumes_exactly_from_its_state_or_by_replaying(tmp_path: Path) -> None:
    whole = run_ranks(2, _streams_whole_then_stopped, str(tmp_path), timeout_s=240)
    resumed = run_ranks(2, _streams_resumed, str(tmp_path), timeout_s=240)
    for kind, resumable in STREAM_KINDS.items():
        assert resumed[0][kind][0] == resumed[1][kind][0] == whole[0][kind], kind
        # replayed: said so; resumed from its state: silent
        assert resumed[0][kind][1] is (not resumable), kind


def _fsdp_blocks(run_dir: str) -> tuple[list[str], bool]:
    from disttrain.examples.chargpt import Block, CharGPT, CharWindows, encode, lm_step

    codes, vocab = encode("the quick brown fox jumps over the lazy dog " * 20)
    task = TrainTask(model=lambda: CharGPT(len(vocab), block=16, layers=2, width=16, heads=2),
                     train_data=CharWindows(codes, 16, 16), step_fn=lm_step, fsdp_block=Block)
    with setup_for_test() as rt:
        spec = JobSpec.from_dict({}, {"epochs": 1, "batch_size": 8, "run_dir": run_dir,
                                      "strategy": "fsdp", "checkpoint_every_epochs": 0})
        trainer = build_trainer(spec, rt, task)
        summary = trainer.fit()
        names = [type(m).__name__ for m in trainer.model.blocks]
    return names, summary["params_in_sync"]


def test_fsdp_makes_one_unit_per_task_block(tmp_path: Path) -> None:
    out = run_ranks(2, _fsdp_blocks, str(tmp_path / "f"), timeout_s=180)
    names, in_sync = out[0]
    assert in_sync is True
    assert all(name != "Block" and "Block" in name for name in names), names   # FSDPBlock


def test_sync_batchnorm_without_a_gpu_is_refused_with_the_reason() -> None:
    from disttrain.errors import StrategyError
    from disttrain.spec.rules import check_runnable

    spec = JobSpec.from_dict({}, {"sync_batchnorm": True})
    with pytest.raises(StrategyError, match="SyncBatchNorm runs on CUDA GPUs only"):
        check_runnable(spec, gpus=0)
    assert check_runnable(spec, gpus=2) == []


def _sync_bn(run_dir: str) -> tuple[list[str], bool]:
    task = TrainTask(model=make_bn_net, train_data=PairData(), loss_fn=nn.CrossEntropyLoss())
    with setup_for_test("nccl") as rt:
        spec = JobSpec.from_dict({}, {"epochs": 1, "batch_size": 16, "run_dir": run_dir,
                                      "backend": "nccl", "sync_batchnorm": True,
                                      "checkpoint_every_epochs": 0})
        trainer = build_trainer(spec, rt, task)
        summary = trainer.fit()
        kinds = [type(m).__name__ for m in trainer.model.modules() if "BatchNorm" in type(m).__name__]
    return kinds, summary["params_in_sync"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 ranks need a CUDA GPU each")
def test_sync_batchnorm_converts_and_stays_in_sync(tmp_path: Path) -> None:
    out = run_ranks(2, _sync_bn, str(tmp_path / "sbn"), timeout_s=120)
    assert out[0] == (["SyncBatchNorm"], True) and out[1] == out[0]
