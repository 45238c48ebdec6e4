"""Each rank takes its share of the cores of the machine it runs on (`ddpkit.distributed.threads`)."""

import os
import subprocess
import sys

from ddpkit.distributed.threads import machine_identity, threads_per_rank, usable_cores


def test_an_even_share_of_the_cores_at_least_one():
    assert threads_per_rank(16, 1) == 16
    assert threads_per_rank(16, 4) == 4
    assert threads_per_rank(16, 3) == 5
    assert threads_per_rank(2, 2) == 1
    assert threads_per_rank(2, 8) == 1  # more ranks than cores: one each, never zero
    assert threads_per_rank(16, 0) == 16


def test_omp_num_threads_wins_when_it_is_a_positive_integer():
    assert threads_per_rank(16, 4, "3") == 3
    assert threads_per_rank(2, 2, "8") == 8
    for ignored in ("", "0", "-1", "two", "1.5"):
        assert threads_per_rank(16, 4, ignored) == 4, ignored


def test_the_machine_is_the_kernel_and_the_cpu_set_not_the_network_namespace():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert machine_identity() == f"{boot}|{','.join(map(str, sorted(os.sched_getaffinity(0))))}"
    assert usable_cores() == len(os.sched_getaffinity(0))
    # a process narrowed to one CPU (as by a container's cpuset) is another machine as far as cores go
    probe = "from ddpkit.distributed.threads import machine_identity as m, usable_cores as c; print(m(), c())"
    first = sorted(os.sched_getaffinity(0))[0]
    narrowed = subprocess.run(
        ["taskset", "-c", str(first), sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert narrowed.returncode == 0, narrowed.stderr
    identity, cores = narrowed.stdout.split()
    assert identity == f"{boot}|{first}" and cores == "1"


def test_fault_tolerant_ranks_count_the_members_on_their_machine_through_the_store(monkeypatch):
    """A fault-tolerant rank has no group spanning the job: it counts the round's members that wrote its machine
    identity into the store (a rank on another machine, or one that never wrote, does not count)."""
    import torch
    import torch.distributed as dist

    from ddpkit.distributed.threads import publish_machine, share_cores_through_store

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    store, keys = dist.HashStore(), "job/machine/"
    try:
        publish_machine(store, keys, 0)
        publish_machine(store, keys, 1)  # (this process again: the same machine)
        store.set(f"{keys}2", "another-boot|0,1")  # a rank on another machine
        cores = usable_cores()
        assert share_cores_through_store(store, keys, 0, [0, 1, 2, 3]) == threads_per_rank(cores, 2)  # 3: unknown
        assert torch.get_num_threads() == threads_per_rank(cores, 2)
        assert share_cores_through_store(store, keys, 0, [0, 2]) == cores
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert share_cores_through_store(store, keys, 0, [0, 1]) == 3
    finally:
        torch.set_num_threads(before)
