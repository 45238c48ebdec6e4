"""The stdlib text corpus: which files, the split by file, windows, sharding across world sizes, bits per byte."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data.distributed import DistributedSampler

from ddpkit.train.workloads import text as textmod
from ddpkit.train.workloads.text import ByteWindows, bits_per_byte, is_heldout, split_files, stdlib_files, text


def _tree(root: Path, count: int = 40) -> None:
    for i in range(count):
        folder = root / ("pkg" if i % 2 else "") / ("sub" if i % 3 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"m{i:02d}.py").write_bytes(f"# module {i}\n".encode() + bytes([i]) * (100 + 7 * i))
    for skipped in ("test", "tests", "idle_test", "site-packages/x", "__pycache__"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "t.py").write_text("skipped\n")
    (root / "notes.txt").write_text("not python\n")


def test_file_selection_is_sorted_and_skips_tests_and_installed_packages(tmp_path):
    _tree(tmp_path)
    files = stdlib_files(tmp_path)
    assert files == sorted(files) and len(files) == 40
    assert not any("test" in f or "site-packages" in f or "pycache" in f or f.endswith(".txt") for f in files)
    assert "pkg/sub/m03.py" in files and "m00.py" not in files and "sub/m00.py" in files


def test_split_is_by_path_hash_and_stable(tmp_path):
    _tree(tmp_path)
    files = stdlib_files(tmp_path)
    train, held = split_files(files, 0.3)
    assert set(train).isdisjoint(held) and sorted(train + held) == files
    for f in files:
        value = int.from_bytes(hashlib.sha256(f.encode()).digest()[:8], "big")
        assert (f in held) == (value < 0.3 * 2**64)
    # a file's side depends on its own path only: dropping files never moves the others
    train2, held2 = split_files(files[::2], 0.3)
    assert set(held2) == set(held) & set(files[::2]) and set(train2) == set(train) & set(files[::2])
    assert is_heldout("a.py", 0.999999) and not is_heldout("a.py", 1e-9)


def test_windows_tile_the_bytes_and_targets_are_shifted(tmp_path):
    data = torch.arange(103, dtype=torch.uint8)
    windows = ByteWindows.tiled(data, 10)
    assert len(windows) == 10 and windows.num_bytes == 100  # (103 - 1) // 10
    x, y = windows[3]
    assert x.dtype == torch.long and x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    spaced = ByteWindows.tiled(data, 10, limit=4)
    assert spaced.starts.tolist() == [0, 20, 50, 70]
    with pytest.raises(ValueError, match="past the end"):
        ByteWindows(data, 10, torch.tensor([95]))


def test_text_factory_on_a_tree(tmp_path):
    _tree(tmp_path)
    train, held = text(context=8, heldout_fraction=0.3, heldout_bytes=None, root=tmp_path)
    train_files, held_files = split_files(stdlib_files(tmp_path), 0.3)
    expected = b"".join((tmp_path / f).read_bytes() for f in train_files)
    assert bytes(train.data.tolist()) == expected and len(train) == (len(expected) - 1) // 8
    assert len(held) == (sum(len((tmp_path / f).read_bytes()) for f in held_files) - 1) // 8
    again, _ = text(context=8, heldout_fraction=0.3, heldout_bytes=None, root=tmp_path)
    assert torch.equal(again.data, train.data)
    _, capped = text(context=8, heldout_fraction=0.3, heldout_bytes=64, root=tmp_path)
    assert len(capped) == 8
    with pytest.raises(ValueError, match="context must be an integer >= 1"):
        text(context=0, root=tmp_path)
    with pytest.raises(ValueError, match="heldout_fraction"):
        text(heldout_fraction=1.5, root=tmp_path)
    with pytest.raises(ValueError, match="too few"):
        text(root=tmp_path / "pkg" / "sub", heldout_fraction=0.01)


def test_the_real_stdlib_corpus():
    train, held = text(context=128)
    files = stdlib_files()
    assert len(files) > 300 and all(f.endswith(".py") for f in files)
    assert len(train.data) > 3_000_000  # several MB of training text
    assert len(held) == textmod.DEFAULT_HELDOUT_BYTES // 128
    _, held_files = split_files(files)
    assert 0.02 < len(held_files) / len(files) < 0.1
    assert "os.py" in files and "json/decoder.py" in files
    x, y = train[0]
    assert x.shape == y.shape == (128,) and torch.equal(x[1:], y[:-1])


def _step_windows(dataset_len: int, world: int, batch: int, step: int, epoch: int = 0) -> set[int]:
    taken: set[int] = set()
    for rank in range(world):
        sampler = DistributedSampler(range(dataset_len), world, rank, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        order = list(sampler)
        taken |= set(order[step * batch : (step + 1) * batch])
    return taken


def test_sharding_rule_same_global_batch_same_windows_at_any_world_size():
    # the rule text.py documents: step s consumes P[s*b*W:(s+1)*b*W] of one permutation P, whatever W is
    for step in (0, 3):
        one = _step_windows(960, 1, 16, step)
        assert _step_windows(960, 2, 8, step) == one == _step_windows(960, 4, 4, step)
        assert len(one) == 16
    assert _step_windows(960, 2, 8, 0, epoch=1) != _step_windows(960, 2, 8, 0, epoch=0)


def test_bits_per_byte_formula():
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    logits = torch.zeros(5, 256)  # a uniform guess: 8 bits per byte
    assert bits_per_byte(F.cross_entropy(logits, torch.randint(0, 256, (5,))).item()) == pytest.approx(8.0)
