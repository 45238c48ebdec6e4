"""The foundation: the rank runner, the counted collectives and object transfer."""

import pytest
import torch
import torch.distributed as dist

from ddpkit.distributed import comm, comm_stats
from ddpkit.distributed.objects import broadcast_object, gather_objects
from ddpkit.distributed.stats import CommStats, wire_bytes
from ddpkit.testing import DistributedTimeout, run_distributed


def _collectives(rank, world):
    comm_stats.reset()
    t = torch.full((10,), float(rank + 1))
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((10,), float(sum(range(1, world + 1)))))
    b = torch.arange(6, dtype=torch.float64) * (rank == 0)
    comm.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(6, dtype=torch.float64))
    r = torch.ones(4, dtype=torch.float16)
    comm.reduce(r, dst=world - 1)
    if rank == world - 1:
        assert torch.equal(r, torch.full((4,), float(world), dtype=torch.float16))
    out = [torch.zeros(3) for _ in range(world)]
    comm.all_gather(out, torch.full((3,), float(rank)))
    assert [o[0].item() for o in out] == list(range(world))
    obj = broadcast_object({"rank": rank, "t": torch.ones(2)}, src=world - 1)
    assert obj["rank"] == world - 1
    gathered = gather_objects(("x" * (rank + 1), rank), dst=0)
    if rank == 0:
        assert gathered == [("x" * (i + 1), i) for i in range(world)]
    else:
        assert gathered is None
    assert gather_objects(rank, dst=-1) == list(range(world))
    return {k: (c.calls, c.payload_bytes, c.sent_bytes) for k, c in comm_stats.snapshot().items()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_are_counted_exactly(world):
    stats = run_distributed(_collectives, world)
    n = world
    for rank, s in enumerate(stats):
        assert s[("all_reduce", "world")] == (1, 40, 2 * (n - 1) / n * 40)
        # gloo reduce goes point to point: each non-root sends its tensor once, the root sends nothing
        assert s[("reduce", "world")] == (1, 8, 0.0 if rank == world - 1 else 8.0)
        # broadcast: 48 bytes of float64 + broadcast_object's size (8 bytes) and its payload
        calls, payload, sent = s[("broadcast", "world")]
        assert calls == 3 and payload > 48 + 8
        # gloo broadcast goes point to point too: the root sends the tensor to each other rank, the others nothing;
        # rank 0 was the root of the 48-byte tensor, the last rank of the object's two
        expected = {0: 48.0, n - 1: payload - 48.0} if n > 1 else {}
        assert sent == (n - 1) * expected.get(rank, 0.0), (rank, sent, payload)
        assert s[("all_gather", "world")][0] == 4  # tensors; sizes for dst=0; sizes and bytes for dst=-1
        gather_calls = s[("gather", "world")][0]
        assert gather_calls == 1
        if rank == 0:
            assert s[("gather", "world")][2] == 0  # the root sends nothing


def test_wire_model():
    assert wire_bytes("all_reduce", 100, 4) == 150
    assert wire_bytes("reduce", 100, 4) + wire_bytes("broadcast", 100, 4) == wire_bytes("all_reduce", 100, 4)
    assert wire_bytes("broadcast", 100, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("send", 1, 2)


def test_measure_counts_only_the_block():
    stats = CommStats()
    stats.record("broadcast", "world", 10, 5.0)
    with stats.measure() as delta:
        stats.record("broadcast", "world", 7, 3.5)
        stats.record("reduce", "ranks[0,1]", 4, 2.0)
    assert delta.calls() == 2 and delta.payload_bytes("broadcast") == 7
    assert delta.sent_bytes(group="ranks[0,1]") == 2.0
    assert stats.calls("broadcast") == 2
    assert "broadcast" in stats.table()


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("bad value on rank one")
    return rank


def _hangs_on_rank_zero(rank, world):
    if rank == 0:
        dist.barrier()  # rank 1 never joins


def _no_process_group(rank, world):
    return dist.is_initialized()


def test_runner_reraises_the_failing_rank_with_its_traceback():
    with pytest.raises(ValueError, match="bad value on rank one") as info:
        run_distributed(_fails_on_rank_one, 2)
    assert "rank 1 of 2 failed" in str(info.value.__cause__)
    assert "_fails_on_rank_one" in str(info.value.__cause__)
    assert run_distributed(_no_process_group, 2) == [True, True]  # the pool survived a clean failure


def test_runner_times_out_instead_of_hanging():
    # ranks already up: the 5 s must not include starting them (importing torch), or neither rank returns in time
    assert run_distributed(_no_process_group, 2) == [True, True]
    with pytest.raises(DistributedTimeout, match=r"ranks \[0\] of 2 did not finish"):
        run_distributed(_hangs_on_rank_zero, 2, timeout=5)
    assert run_distributed(_no_process_group, 2) == [True, True]  # a fresh pool replaced the stuck one


def test_runner_without_process_group():
    assert run_distributed(_no_process_group, 2, init=False) == [False, False]


def test_free_port_avoids_the_ephemeral_range_and_never_repeats():
    """Rank 0 binds the port seconds after it is chosen: no outgoing connection may be given it meanwhile."""
    import socket
    from pathlib import Path

    from ddpkit.distributed.launch import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(1024 <= p < min(low, 30000) and not 29400 <= p < 29600 for p in ports), ports
    with socket.socket() as s:
        s.bind(("0.0.0.0", ports[-1]))  # still free


def test_litter_in_dev_shm_is_swept_only_when_its_writer_is_gone_and_it_is_old(tmp_path):
    """A rank killed between creating a segment and its peers mapping it leaves the file; later jobs remove it,
    never a live job's segment (writer alive, or too young to be litter)."""
    import os
    import subprocess
    import uuid

    from ddpkit.distributed.segment_files import STALE_AFTER_SECONDS, pid_namespace, sweep_stale

    gone = subprocess.Popen(["true"])
    gone.wait()
    now, ns = 1e9, pid_namespace()
    files = {
        "litter": f"ddpkit-{uuid.uuid4().hex}-{ns}-{gone.pid}-mailbox-b0-1",
        "writer alive": f"ddpkit-{uuid.uuid4().hex}-{ns}-{os.getpid()}-0",
        "young": f"ddpkit-{uuid.uuid4().hex}-{ns}-{gone.pid}-1",
        "another pid namespace": f"ddpkit-{uuid.uuid4().hex}-{ns + 1}-{gone.pid}-1",
        "a pid no kernel has": f"ddpkit-{uuid.uuid4().hex}-{ns}-99999999999-1",
        "not ours": f"other-{uuid.uuid4().hex}-{ns}-{gone.pid}-1",
    }
    for what, name in files.items():
        (tmp_path / name).write_bytes(b"x")
        age = 1 if what == "young" else STALE_AFTER_SECONDS + 1
        os.utime(tmp_path / name, (now - age, now - age))
    assert sweep_stale(str(tmp_path), now=now) == [files["litter"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for w, n in files.items() if w != "litter")


def _missing_segment(rank, world):
    from ddpkit.distributed.shared_memory import SharedSegments

    segments = SharedSegments.agree(None, 1024)
    if segments is None:  # no room in /dev/shm here (e.g. a container's 64 MiB)
        return None
    if rank == 0:
        segments.create("x", 4, torch.float32)
    dist.barrier()
    if rank == 0:
        segments.remove("x", 0)
    dist.barrier()
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"segment .* of rank 0 is missing.*DDPKIT_SHARED_MEMORY=0"):
            segments.attach("x", 0, 4, torch.float32)
    return True


def test_a_missing_segment_is_an_error_not_zeros():
    results = run_distributed(_missing_segment, 2)
    if results == [None, None]:
        pytest.skip("no room for shared-memory segments in /dev/shm here")
    assert results == [True, True]
