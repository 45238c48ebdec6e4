"""glibc's handling of large blocks (ddpkit.distributed.allocator): when huge pages are available, what a launcher
adds to its ranks' environment (a user's own setting winning), and that a mapped threshold really gives freed
blocks back to the system (a fresh process measures its resident size)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ddpkit.distributed import allocator
from ddpkit.train.settings.config import TrainConfig


@pytest.mark.parametrize(
    ("version", "mode", "expected"),
    [
        ((2, 36), "madvise", True),
        ((2, 35), "always", True),
        ((2, 34), "always", False),  # glibc.malloc.hugetlb came in 2.35
        ((2, 36), "never", False),
        ((2, 36), "", False),  # no such setting (not Linux)
        (None, "always", False),  # not glibc
    ],
)
def test_huge_pages_need_glibc_2_35_and_the_kernels_huge_pages(version, mode, expected):
    assert allocator.huge_pages_possible(version, mode) is expected


def test_the_kernels_mode_is_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert allocator.transparent_huge_pages(str(setting)) == "madvise"
    assert allocator.transparent_huge_pages(str(tmp_path / "missing")) == ""


def test_a_launcher_adds_huge_pages_to_the_tunables_already_there(monkeypatch):
    monkeypatch.setattr(allocator, "huge_pages_available", lambda: True)
    assert allocator.huge_pages_environment({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert allocator.huge_pages_environment(mine) == {
        "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    }
    assert allocator.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}  # the user's wins
    monkeypatch.setattr(allocator, "huge_pages_available", lambda: False)
    assert allocator.huge_pages_environment({}) == {}


def test_the_starting_environment_says_whether_huge_pages_and_a_threshold_were_chosen(tmp_path):
    environ = tmp_path / "environ"
    environ.write_bytes(b"PATH=/bin\0GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1\0EMPTY=\0")
    started = allocator.started_environment(str(environ))
    assert started["EMPTY"] == "" and started["PATH"] == "/bin"
    assert allocator.started_with_huge_pages(started)
    assert not allocator.started_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not allocator.threshold_chosen_by_user(started)
    assert allocator.threshold_chosen_by_user({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert allocator.threshold_chosen_by_user({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})
    assert not allocator.map_large_blocks(environ={"MALLOC_MMAP_THRESHOLD_": "65536"})  # the user's stands


def test_auto_maps_large_blocks_for_the_strategy_that_frees_gradients_only():
    assert TrainConfig(strategy="sharded").maps_large_blocks
    assert not TrainConfig(strategy="ddp").maps_large_blocks
    assert TrainConfig(strategy="ddp", allocator="mapped").maps_large_blocks
    assert not TrainConfig(strategy="sharded", allocator="default").maps_large_blocks


RETAINED = textwrap.dedent(
    """
    import sys
    from ddpkit.distributed import allocator

    def resident_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    if sys.argv[1] == "mapped":
        assert allocator.map_large_blocks(environ={})
    before = resident_mb()
    later = []
    for _ in range(3):  # glibc maps the first 16 MiB block alone, then raises its threshold past that size
        block = bytearray(16 * 2**20)
        for page in range(0, len(block), 4096):  # every page touched (a fresh mapping is zero without touching)
            block[page] = 1
        later.append(bytearray(2**18))  # from the heap after it: the freed block is not its top, so kept
        del block
    print(resident_mb() - before)
    """
)


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc's allocator only")
def test_a_freed_large_block_goes_back_to_the_system_only_when_mapped_alone():
    """glibc's default keeps a freed 16 MiB block in its heap (the process stays 16 MiB larger); with blocks of
    8 MiB or more mapped alone it is unmapped when freed."""
    kept = {}
    for setting in ("default", "mapped"):
        run = subprocess.run(
            [sys.executable, "-c", RETAINED, setting], capture_output=True, text=True, timeout=60, check=True
        )
        kept[setting] = float(run.stdout)
    assert kept["default"] > 12, kept
    assert kept["mapped"] < 2, kept
