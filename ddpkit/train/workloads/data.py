"""Datasets that never download: scikit-learn's bundled digits, MNIST IDX files from a folder, synthetic data."""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass
class Data:
    """A train/test split with what a model needs to know about its inputs."""

    train: TensorDataset
    test: TensorDataset
    image_shape: tuple[int, int, int] | None  # (channels, height, width), None for plain feature vectors
    num_features: int
    num_classes: int


def _standardize(train_x: torch.Tensor, test_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, (test_x - mean) / std


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as (images of 64 values 0..16, labels), read from the CSV file that the
    scikit-learn package ships. The file is located without importing scikit-learn, whose import (scipy with it)
    costs each rank seconds of CPU at start-up; the values are those of ``sklearn.datasets.load_digits``."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits data comes with scikit-learn: pip install scikit-learn")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits(seed: int = 0) -> Data:
    """scikit-learn's 1,797 8x8 handwritten digits, split 80/20 with a fixed permutation."""
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    train_x, test_x = _standardize(x[order[:split]], x[order[split:]])
    return Data(TensorDataset(train_x, y[order[:split]]), TensorDataset(test_x, y[order[split:]]), (1, 8, 8), 64, 10)


def mnist_paths(data_dir: str) -> dict[str, str]:
    """The four IDX files in `data_dir` (each gzipped or not); a FileNotFoundError names what is missing."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"--data-dir {data_dir!r} is not a directory; it must hold the four MNIST IDX files")
    found, missing = {}, []
    for key, name in MNIST_FILES.items():
        for candidate in (name, name + ".gz"):
            path = os.path.join(data_dir, candidate)
            if os.path.isfile(path):
                found[key] = path
                break
        else:
            missing.append(name + "[.gz]")
    if missing:
        raise FileNotFoundError(f"MNIST files missing in {data_dir!r}: {', '.join(missing)}")
    return found


def read_idx(path: str) -> np.ndarray:
    """Reads one IDX file (unsigned bytes, big-endian header), gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex()})")
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but the file holds {data.size} values")
    return data.reshape(shape)


def mnist(data_dir: str) -> Data:
    """MNIST from the four standard IDX files in `data_dir`."""
    paths = mnist_paths(data_dir)
    arrays = {key: read_idx(path) for key, path in paths.items()}
    train_x = torch.tensor(arrays["train_images"], dtype=torch.float32).unsqueeze(1) / 255.0
    test_x = torch.tensor(arrays["test_images"], dtype=torch.float32).unsqueeze(1) / 255.0
    train_x, test_x = _standardize(train_x, test_x)
    train_y = torch.tensor(arrays["train_labels"], dtype=torch.long)
    test_y = torch.tensor(arrays["test_labels"], dtype=torch.long)
    side = train_x.shape[-1]
    return Data(TensorDataset(train_x, train_y), TensorDataset(test_x, test_y), (1, side, side), side * side, 10)


def synthetic(samples: int, features: int, classes: int, seed: int = 0) -> Data:
    """Gaussian inputs labelled by a random linear teacher: learnable, any size, the same on every rank.

    A square number of features is announced and shaped as a one-channel image (64: 1x8x8), so a CNN can take it;
    an MLP flattens it back."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher).argmax(1)
    split = max(1, int(0.9 * samples))
    side = round(features**0.5)
    shape = (1, side, side) if side * side == features else None
    if shape is not None:
        x = x.reshape(samples, *shape)
    return Data(TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:]), shape, features, classes)
