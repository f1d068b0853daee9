"""The built-in tasks' datasets, all offline unless asked to download (`download`).

    data = load_dataset("digits")                   # scikit-learn's bundled digits
    data.train_x, data.train_y, data.test_x, data.test_y, data.num_classes

- digits: scikit-learn's bundled 8x8 handwritten digits (1,797 real images), read from
  the CSV that ships inside scikit-learn, without importing scikit-learn (~0.5 s saved).
- mnist: IDX files in a local folder (default /data/mnist, where the cluster's pods mount
  it), raw or .gz, flat or in torchvision's `MNIST/raw/` layout. Downloaded only with
  `--download`.
- synthetic: Gaussian inputs labelled by a fixed random linear teacher, so the loss
  really falls; the benchmark workload.
- seed002: the smoke workload, Linear(1000, 10) on random data and labels.

Each is small enough to hold in memory as tensors (`TrainTestTensors`), which the rank
loader (`disttrain.train.loader.ShardedLoader`) batches with one gather per batch. The warm
fork server may load one before it forks the workers (`warm_dataset`), so local workers
share one copy.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from disttrain.errors import DatasetError
from disttrain.spec.paths import file_problem

MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
DEFAULT_MNIST_DIR = "/data/mnist"


@dataclass
class TrainTestTensors:
    """A built-in workload's data: train and held-out test tensors, whole in memory
    (inputs float32, labels int64), which `ShardedLoader` batches without a Dataset."""

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


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> TrainTestTensors:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TrainTestTensors(x[train].contiguous(), y[train].contiguous(), x[test].contiguous(),
                  y[test].contiguous())


def load_digits() -> TrainTestTensors:
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
                if file_problem(candidate) is None:  # no OSError on a too-long --data-dir
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


def load_mnist(data_dir: str | None, download: bool = False) -> TrainTestTensors:
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
    return TrainTestTensors(
        _normalise(arrays["train_x"], 255.0), torch.from_numpy(arrays["train_y"].astype(np.int64)),
        _normalise(arrays["test_x"], 255.0), torch.from_numpy(arrays["test_y"].astype(np.int64)))


def load_synthetic(num_samples: int = 60_000, input_size: int = 784, num_classes: int = 10,
                   seed: int = 1234) -> TrainTestTensors:
    """Inputs N(0, 1), labels argmax(x @ W) of a fixed teacher: learnable, offline, any size."""
    g = torch.Generator().manual_seed(seed)
    n_test = max(num_samples // 10, 1)
    x = torch.randn(num_samples + n_test, input_size, generator=g)
    teacher = torch.randn(input_size, num_classes, generator=torch.Generator().manual_seed(4321))
    y = (x @ teacher).argmax(dim=1)
    return TrainTestTensors(x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:], num_classes)


def load_seed002(num_samples: int = 2048, input_size: int = 1000, seed: int = 1234) -> TrainTestTensors:
    """Random inputs and random labels: a smoke test of the plumbing, the loss need not fall far."""
    g = torch.Generator().manual_seed(seed)
    n_test = max(num_samples // 8, 1)
    x = torch.randn(num_samples + n_test, input_size, generator=g)
    y = torch.randint(0, 10, (num_samples + n_test,), generator=g)
    return TrainTestTensors(x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:])


# Data loaded by the warm fork server before it forks the workers (`warm_dataset`): the
# forks share these tensors' pages read-only (copy-on-write), so N local workers hold one
# copy and none of them spends start-up time making it.
_warm: dict[tuple[str, str | None, int | None, int | None], TrainTestTensors] = {}


def load_dataset(workload: str, *, data_dir: str | None = None, download: bool = False,
                 num_samples: int | None = None, input_size: int | None = None) -> TrainTestTensors:
    """The data of a built-in workload (the fork server's copy when it made this one)."""
    warm = _warm.get((workload, data_dir, num_samples, input_size))
    if warm is not None:
        return warm
    if workload == "digits":
        return load_digits()
    if workload == "mnist":
        return load_mnist(data_dir, download)
    if workload == "synthetic":
        return load_synthetic(num_samples or 60_000, input_size or 784)
    if workload == "seed002":
        return load_seed002(num_samples or 2048, input_size or 1000)
    raise DatasetError(f"unknown dataset {workload!r}; choose digits, mnist, synthetic or seed002")


def warm_dataset(workload: str, data_dir: str | None = None, num_samples: int | None = None,
                 input_size: int | None = None) -> bool:
    """Load a built-in workload's data into this process for its forks (never downloads).

    Called by the warm fork server (`disttrain.launch.forkserver_preload`) while it imports torch._dynamo,
    on the core the launcher leaves idle then. Returns False when the data cannot be
    loaded without a download (the workers then load it themselves and report why).
    """
    try:
        data = load_dataset(workload, data_dir=data_dir, num_samples=num_samples,
                              input_size=input_size)
    except Exception:  # a worker loads it again and reports the cause
        return False
    _warm[(workload, data_dir, num_samples, input_size)] = data
    return True


def is_warm(data: TrainTestTensors) -> bool:
    """Whether these data are the fork server's shared copy."""
    return any(data is s for s in _warm.values())
