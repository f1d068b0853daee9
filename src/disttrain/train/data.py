"""Built-in datasets (all offline unless `--download`) and the fast sharded batch loader.

    splits = load_dataset("digits")                 # scikit-learn's bundled digits
    loader = ShardedLoader(splits.train_x, splits.train_y, batch_size=32, rank=0, world_size=2)

Data sets:
- digits: scikit-learn's bundled 8x8 handwritten digits (1,797 real images), read from
  the CSV that ships inside scikit-learn, without importing scikit-learn (~0.5 s saved).
- mnist: IDX files in a local folder (seed 000's /data/mnist), raw or .gz, flat or in
  torchvision's `MNIST/raw/` layout. Downloaded only with `--download`.
- synthetic: Gaussian inputs labelled by a fixed random linear teacher, so the loss
  really falls; the benchmark workload.
- seed002: seed 002's smoke workload, Linear(1000, 10) on random data and labels.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from disttrain.distributed.runtime import rank_seed
from disttrain.errors import DatasetError

MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
DEFAULT_MNIST_DIR = "/data/mnist"



@dataclass
class Splits:
    """Train and held-out test tensors (inputs float32, labels int64)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int = 10

    @property
    def input_size(self) -> int:
        return int(self.train_x[0].numel())


def _normalise(images: np.ndarray, scale: float) -> torch.Tensor:
    """Scale to [0, 1] then Normalize((0.5,), (0.5,)) as the guide's transform does."""
    x = torch.from_numpy(images.astype(np.float32) / scale)
    return (x - 0.5) / 0.5


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> Splits:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Splits(x[train].contiguous(), y[train].contiguous(), x[test].contiguous(),
                  y[test].contiguous())


def load_digits() -> Splits:
    """scikit-learn's digits: 1,797 8x8 images, a fixed 80/20 split."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("dataset 'digits' needs scikit-learn (pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():
        raise DatasetError(f"dataset 'digits': {path} is missing from the scikit-learn install")
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = _normalise(table[:, :-1], 16.0)
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    return _split(x, y, 0.2, seed=1234)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise DatasetError(f"{path}: too short to be an IDX file")
    _, _, dtype_code, ndim = struct.unpack(">BBBB", data[:4])
    if dtype_code != 0x08:
        raise DatasetError(f"{path}: IDX type 0x{dtype_code:02x} is not unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise DatasetError(f"{path}: truncated ({body.size} of {int(np.prod(shape))} bytes)")
    return body.reshape(shape)


def mnist_candidates(root: Path) -> list[Path]:
    """Folders searched for the IDX files, in order."""
    return [root, root / "raw", root / "MNIST" / "raw"]


def find_mnist(root: Path) -> dict[str, Path] | None:
    for folder in mnist_candidates(root):
        found = {}
        for key, stem in MNIST_FILES.items():
            for candidate in (folder / stem, folder / f"{stem}.gz"):
                if candidate.is_file():
                    found[key] = candidate
                    break
        if len(found) == len(MNIST_FILES):
            return found
    return None


def download_mnist(root: Path) -> None:
    """Fetch the four .gz files into `root` (only on explicit --download)."""
    import urllib.request

    root.mkdir(parents=True, exist_ok=True)
    for stem in MNIST_FILES.values():
        target = root / f"{stem}.gz"
        if not target.exists():
            # per-process name: nodes sharing a filesystem may download at the same time
            tmp = target.with_suffix(f".gz.{os.getpid()}.part")
            urllib.request.urlretrieve(MNIST_MIRROR + target.name, tmp)
            tmp.replace(target)


def load_mnist(data_dir: str | None, download: bool = False) -> Splits:
    """MNIST from IDX files; never downloads unless asked."""
    root = Path(data_dir or DEFAULT_MNIST_DIR)
    files = find_mnist(root)
    if files is None and download:
        download_mnist(root)
        files = find_mnist(root)
    if files is None:
        looked = ", ".join(str(p) for p in mnist_candidates(root))
        raise DatasetError(
            f"dataset 'mnist': IDX files ({', '.join(MNIST_FILES.values())}, raw or .gz) not "
            f"found in {looked}; put them there, pass --data-dir, or add --download")
    arrays = {k: _read_idx(p) for k, p in files.items()}
    return Splits(_normalise(arrays["train_x"], 255.0), torch.from_numpy(arrays["train_y"].astype(np.int64)),
                  _normalise(arrays["test_x"], 255.0), torch.from_numpy(arrays["test_y"].astype(np.int64)))


def load_synthetic(num_samples: int = 60_000, input_size: int = 784, num_classes: int = 10,
                   seed: int = 1234) -> Splits:
    """Inputs N(0, 1), labels argmax(x @ W) of a fixed teacher: learnable, offline, any size."""
    g = torch.Generator().manual_seed(seed)
    n_test = max(num_samples // 10, 1)
    x = torch.randn(num_samples + n_test, input_size, generator=g)
    teacher = torch.randn(input_size, num_classes, generator=torch.Generator().manual_seed(4321))
    y = (x @ teacher).argmax(dim=1)
    return Splits(x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:], num_classes)


def load_seed002(num_samples: int = 2048, input_size: int = 1000, seed: int = 1234) -> Splits:
    """Seed 002's random data and random labels (a smoke test: the loss need not fall far)."""
    g = torch.Generator().manual_seed(seed)
    n_test = max(num_samples // 8, 1)
    x = torch.randn(num_samples + n_test, input_size, generator=g)
    y = torch.randint(0, 10, (num_samples + n_test,), generator=g)
    return Splits(x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:])


# Data loaded by the warm fork server before it forks the workers (`warm_dataset`): the
# forks share these tensors' pages read-only (copy-on-write), so N local workers hold one
# copy and none of them spends start-up time making it.
_warm: dict[tuple[str, str | None, int | None, int | None], Splits] = {}


def load_dataset(example: str, *, data_dir: str | None = None, download: bool = False,
                 num_samples: int | None = None, input_size: int | None = None) -> Splits:
    """The data of a built-in example (the fork server's copy when it made this one)."""
    warm = _warm.get((example, data_dir, num_samples, input_size))
    if warm is not None:
        return warm
    if example == "digits":
        return load_digits()
    if example == "mnist":
        return load_mnist(data_dir, download)
    if example == "synthetic":
        return load_synthetic(num_samples or 60_000, input_size or 784)
    if example == "seed002":
        return load_seed002(num_samples or 2048, input_size or 1000)
    raise DatasetError(f"unknown dataset {example!r}; choose digits, mnist, synthetic or seed002")


def warm_dataset(example: str, data_dir: str | None = None, num_samples: int | None = None,
                 input_size: int | None = None) -> bool:
    """Load a built-in example's data into this process for its forks (never downloads).

    Called by the warm fork server (`disttrain.launch.forkserver_preload`) while it imports torch._dynamo,
    on the core the launcher leaves idle then. Returns False when the data cannot be
    loaded without a download (the workers then load it themselves and report why).
    """
    try:
        splits = load_dataset(example, data_dir=data_dir, num_samples=num_samples,
                              input_size=input_size)
    except Exception:  # a worker loads it again and reports the cause
        return False
    _warm[(example, data_dir, num_samples, input_size)] = splits
    return True


def is_warm(splits: Splits) -> bool:
    """Whether these splits are the fork server's shared copy."""
    return any(splits is s for s in _warm.values())


Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def batch_seed(seed: int, rank: int, epoch: int, batch: int) -> int:
    """The augmentation seed of one batch: distinct per rank (seed 002: "each process a
    different random seed, so they do not draw the same noise"), reproducible, and the
    same whether the batch is made in the training process or in a DataLoader worker, or
    after a resume in the middle of an epoch."""
    return (rank_seed(seed, rank) * 1_000_003 + epoch * 100_003 + batch) % 2**63


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and `random` from the worker's torch seed.

    torch seeds each worker with base_seed + worker_id, and base_seed comes from the
    loader's generator, which ShardedLoader seeds per rank and epoch (`rank_seed`); numpy
    and `random` would otherwise be forked copies, identical in every worker and rank.
    """
    import random

    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


class _Batches(torch.utils.data.Dataset):
    """Whole batches by batch number, so a worker gathers a batch in one index_select."""

    def __init__(self, loader: ShardedLoader, order: torch.Tensor, epoch: int):
        self.loader, self.order, self.epoch = loader, order, epoch

    def __len__(self) -> int:
        return -(-len(self.order) // self.loader.batch_size)

    def __getitem__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.make_batch(self.order, b, self.epoch)


class ShardedLoader:
    """This rank's batches in DistributedSampler order, one tensor gather per batch.

    Yields exactly what `DataLoader(TensorDataset(x, y), batch_size, sampler=
    DistributedSampler(...))` yields, without per-sample __getitem__ and collate: for
    in-memory tensors that Python loop costs more than a small model's step.

    With `num_workers > 0` batches are made in DataLoader worker processes (for costly
    `transform`s), in the same order and with the same values. `transform(x, generator)`
    is an augmentation; its generator is seeded per (seed, rank, epoch, batch).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_workers: int = 0,
                 transform: Transform | None = None):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rank, self.seed, self.num_workers, self.transform = rank, seed, num_workers, transform
        self.sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size,
                                          rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def batch_len(self, i: int) -> int:
        """Samples in batch `i` of an epoch (all full but possibly the last)."""
        return min(self.batch_size, len(self.sampler) - i * self.batch_size)

    def make_batch(self, order: torch.Tensor, b: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = order[b * self.batch_size:(b + 1) * self.batch_size]
        x = self.x.index_select(0, idx)
        if self.transform is not None:
            g = torch.Generator().manual_seed(batch_seed(self.seed, self.rank, epoch, b))
            x = self.transform(x, g)
        return x, self.y.index_select(0, idx)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        start, self.skip = self.skip, 0
        if self.num_workers == 0:
            for b in range(start, len(self)):
                yield self.make_batch(order, b, self.epoch)
            return
        from torch.utils.data import DataLoader

        g = torch.Generator().manual_seed(rank_seed(self.seed, self.rank) + self.epoch)
        loader = DataLoader(_Batches(self, order, self.epoch), batch_size=None,
                            sampler=range(start, len(self)), num_workers=self.num_workers,
                            worker_init_fn=seed_worker, generator=g)
        yield from loader


def eval_shard(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices of the held-out set this rank scores: disjoint, no padding, all covered."""
    return torch.arange(rank, n, world_size)
