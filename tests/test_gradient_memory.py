"""ShardedDataParallel lets a gradient it does not own go as soon as its bucket's transfer is done, and
keeps only its own piece of a parameter cut into pieces once those are reduced.

A rank that does not own a bucket needs its gradients only until they have left: through shared memory that is
when they were copied into the mailbox, over sockets when the send completed. The test counts, at every gradient
hook during backward, the bytes of the gradients the model holds: never more than the rank's own share (about
P/N) plus the few buckets in flight, where keeping every gradient until the end of backward holds P. The
reference is the definition: the parameters each rank owns, from OSS's `owner_of`, sized in the test.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ddpkit.distributed import allocator, comm
from ddpkit.nn import ShardedDataParallel
from ddpkit.nn.sharded_ddp import IN_FLIGHT
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

LAYERS, WIDTH = 16, 512  # each weight 2**18 elements (1 MiB): reduced alone, in place


AHEAD = 2  # ShardedDataParallel(receives_ahead=AHEAD): the bounded receives over sockets


def _live_gradients(rank: int, world_size: int, shared_memory: bool, split: bool = False) -> dict[str, float]:
    os.environ["DDPKIT_SHARED_MEMORY"] = "1" if shared_memory else "0"
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        cut = {"split_params": True, "min_split_numel": WIDTH * WIDTH} if split else {"split_params": False}
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.01, **cut)
        sdp = ShardedDataParallel(model, optimizer, receives_ahead=AHEAD)
        comm._scratch._free.clear()  # (the worker process served other tests before)
        params = list(model.parameters())
        pieces = [optimizer.pieces_of(p)[rank] for p in params if optimizer.pieces_of(p)]
        seen: list[int] = []

        def count(_: torch.Tensor) -> None:
            whole = sum(p.grad.numel() * 4 for p in params if p.grad is not None)
            seen.append(whole + sum(q.tensor.grad.numel() * 4 for q in pieces if q.held and q.tensor.grad is not None))

        for p in params:
            p.register_post_accumulate_grad_hook(count)
        for step in range(2):
            sdp.zero_grad(set_to_none=True)
            torch.manual_seed(rank * 10 + step)
            sdp(torch.randn(4, WIDTH)).pow(2).mean().backward()
            optimizer.step()
        owned = sum(p.numel() * 4 for p in params if optimizer.owner_of(p) == rank)
        owned += sum((q.end - q.start) * 4 for q in pieces)
        assert len(pieces) == (LAYERS if split else 0)
        pooled = sum(t.numel() * t.element_size() for kept in comm._scratch._free.values() for t in kept)
        return {
            "peak": max(seen),
            "owned": owned,
            "one": WIDTH * WIDTH * 4,
            "all": LAYERS * WIDTH * WIDTH * 4,
            "receive_buffers": pooled,  # an owner's receive buffers over sockets: kept for reuse, so the most in use
        }
    finally:
        os.environ.pop("DDPKIT_SHARED_MEMORY", None)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "sockets"])
def test_a_non_owner_holds_its_share_plus_the_buckets_in_flight_during_backward(shared_memory):
    for got in run_distributed(_live_gradients, 2, shared_memory):  # (the rank sets and unsets the switch)
        # its own gradients, the IN_FLIGHT sent buckets not yet done, and the gradient being produced
        assert got["peak"] <= got["owned"] + (IN_FLIGHT + 1) * got["one"], got
        assert got["owned"] + (IN_FLIGHT + 1) * got["one"] < got["all"]  # (the bound is below keeping them all)
        # receives posted AHEAD buckets ahead and completed as far behind: not one buffer per owned bucket
        assert got["receive_buffers"] <= 2 * AHEAD * got["one"] < got["owned"], got


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "sockets"])
def test_a_rank_holds_its_pieces_of_cut_parameters_plus_the_ones_in_flight(shared_memory):
    for got in run_distributed(_live_gradients, 2, shared_memory, True):
        # its pieces, the full gradient being produced and, over sockets, the cut parameter still in flight
        assert got["peak"] <= got["owned"] + 2 * got["one"], got
        assert got["owned"] + 2 * got["one"] < got["all"]


def in_use() -> int:
    """Bytes this process's C allocator has handed out and not had back (glibc's mallinfo2: heap and mappings):
    every tensor alive, whoever holds it, not only what ``p.grad`` names."""
    info = allocator.malloc_info()
    assert info is not None
    return info.uordblks + info.hblkhd


def _live_gradients_on_two_hosts(rank: int, world_size: int, ahead: int | None) -> dict[str, float]:
    """Four ranks playing two hosts of two (the host identity each reports, as tests/test_hierarchical.py does):
    ShardedDataParallel reduces within each host through shared memory, then across; a rank outside a bucket's
    owner lane gives its gradient to stage 1 and may let it go at once. Counted at each gradient hook of the second
    step: the bytes the C allocator handed out since its backward began, so a gradient that a transfer's handle
    still holds counts though ``p.grad`` no longer names it (the model's activations are small beside them)."""
    from ddpkit.distributed import shared_memory

    original = shared_memory.host_identity
    shared_memory.host_identity = lambda: f"test-host-{rank // 2}"  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.01, split_params=False)
        sdp = ShardedDataParallel(model, optimizer, receives_ahead=ahead)
        assert sdp._two_stage is not None  # (hierarchical: the layout was taken as two hosts)
        params = list(model.parameters())
        seen: list[int] = []
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _: seen.append(in_use() - before))
        for step in range(2):
            sdp.zero_grad(set_to_none=True)
            torch.manual_seed(rank * 10 + step)
            loss = sdp(torch.randn(4, WIDTH)).pow(2).mean()
            seen.clear()  # the second step's counts: buffers kept for reuse exist already
            before = in_use()
            loss.backward()
            optimizer.step()
        owners = [optimizer.owner_of(p) for p in params]
        carried = sum(owner != rank and owner % 2 == rank % 2 for owner in owners)  # my lane carries them across
        return {"peak": max(seen), "owned": owners.count(rank), "carried": carried, "one": WIDTH * WIDTH * 4}
    finally:
        shared_memory.host_identity = original  # type: ignore[assignment]


@pytest.mark.skipif(allocator.malloc_info() is None, reason="counts through glibc's mallinfo2")
def test_across_hosts_a_rank_keeps_only_what_its_lane_carries():
    """By default a rank outside a bucket's owner lane lets its gradient go once stage 1 took it; with
    `receives_ahead` also the host sums it carries across (its lane's buckets owned on the other host) go once their
    stage-2 send is done: at most `IN_FLIGHT` wait, where keeping them to the end of backward holds owned + carried."""
    for got in run_distributed(_live_gradients_on_two_hosts, 4, None):
        bound = (got["owned"] + got["carried"] + IN_FLIGHT + 1) * got["one"]
        assert got["peak"] <= bound < LAYERS * got["one"], got
    for got in run_distributed(_live_gradients_on_two_hosts, 4, AHEAD):
        bound = (got["owned"] + IN_FLIGHT + 1) * got["one"]
        assert got["peak"] <= bound < (got["owned"] + got["carried"]) * got["one"], got
