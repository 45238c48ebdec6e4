"""Receives posted before the data they wait for: ShardedDataParallel's reduces and OSS's broadcast over sockets.

Over gloo a point-to-point message is a rendezvous whose ready notice queues behind the receiver's own outgoing
data, so a receive posted late holds the other direction of the link. These tests run the socket path
(``DDPKIT_SHARED_MEMORY=0``, as between hosts) on a small byte GPT at 2 and 4 ranks and check: the parameters
and the owners' gradients equal torch DDP's; the bytes, counted by `comm_stats`, are exactly DDP's; on every rank
every receive of a backward is posted before any of its sends (with ``receives_ahead=k``, k buckets ahead of the
launches, so an owner's receive buffers stay a few buckets) and every receive of an optimizer step
before any of its sends.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm, comm_stats, counting_allreduce_hook
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed
from ddpkit.train.workloads.gpt import GPT, GPTConfig

TOL = 1e-6
CONFIG = GPTConfig(layers=2, width=16, heads=2, context=8)


class _Routed(nn.Module):
    """The tiny GPT plus a head used on every rank, or (`route`) on rank 0 only: an unused parameter elsewhere."""

    def __init__(self, route: bool) -> None:
        super().__init__()
        self.route = route
        torch.manual_seed(0)
        self.gpt = GPT(CONFIG)
        self.extra = nn.Linear(CONFIG.vocab, CONFIG.vocab, bias=False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        logits = self.gpt(x)
        return self.extra(logits) if rank == 0 or not self.route else logits


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, CONFIG.vocab, (3, CONFIG.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return nn.functional.cross_entropy(model(x, rank).flatten(0, 1), y.flatten())


class _OrderSpy:
    """Records, in call order, every point-to-point receive and send this process posts (while `on`)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.on = False
        self._originals = (dist.irecv, dist.isend)

    def __enter__(self) -> "_OrderSpy":
        irecv, isend = self._originals

        def recv(*args, **kwargs):
            if self.on:
                self.events.append("recv")
            return irecv(*args, **kwargs)

        def send(*args, **kwargs):
            if self.on:
                self.events.append("send")
            return isend(*args, **kwargs)

        dist.irecv, dist.isend = recv, send
        return self

    def __exit__(self, *exc: object) -> None:
        dist.irecv, dist.isend = self._originals

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events


def _against_ddp(rank: int, world: int, find_unused: bool, ahead: int | None) -> dict:
    os.environ[SHARED_MEMORY_ENV] = "0"
    try:
        ref, model = _Routed(find_unused), _Routed(find_unused)
        ddp = DDP(ref, find_unused_parameters=find_unused)
        ddp.register_comm_hook(None, counting_allreduce_hook)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        sdp = ShardedDataParallel(
            model, opt, reduce_buffer_size=600, find_unused_parameters=find_unused, receives_ahead=ahead
        )
        out: dict = {"order": []}
        with _OrderSpy() as spy:
            for step in range(4):
                ref_opt.zero_grad()
                opt.zero_grad()
                if step == 2:  # a micro-batch accumulated locally, then the synced one
                    with ddp.no_sync():
                        _loss(ddp, rank, 99).backward()
                    with sdp.no_sync():
                        _loss(sdp, rank, 99).backward()
                with comm_stats.measure() as d_ddp:
                    _loss(ddp, rank, step).backward()
                spy.on = True
                with comm_stats.measure() as d_backward:
                    _loss(sdp, rank, step).backward()
                backward_order = spy.take()
                out["grad_diff"] = max(
                    (p.grad - q.grad).abs().max().item()
                    for p, q in zip(model.parameters(), ref.parameters(), strict=True)
                    if opt.owner_of(p) == rank and p.grad is not None
                )
                with comm_stats.measure() as d_step:
                    opt.step()
                out["order"].append((backward_order, spy.take()))
                spy.on = False
                ref_opt.step()
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        out["param_diff"] = max((p - q).abs().max().item() for p, q in pairs)
        buckets = [(b.owner, b.numel) for b in sdp._buckets]
        out["owned_buckets"] = sum(owner == rank for owner, _ in buckets)
        out["owners_in_launch_order"] = [owner for owner, _ in buckets]
        out["owned_messages"] = sum(m.owner == rank for m in opt._broadcaster.messages)
        out["messages"] = len(opt._broadcaster.messages)
        trainable = sum(p.numel() * 4 for p in model.parameters())
        users = 4 * len(list(model.parameters())) if find_unused else 0  # one fp32 count per parameter
        out["bytes"] = {
            "trainable": trainable,
            "users": users,
            "ddp_sent": d_ddp.sent_bytes(),
            "sdp_sent": d_backward.sent_bytes() + d_step.sent_bytes(),
            "reduce_payload": d_backward.payload_bytes("reduce"),
            "reduce_calls": d_backward.calls("reduce"),
            "buckets": len(buckets),
            "broadcast_payload": d_step.payload_bytes("broadcast"),
            "other_payload": d_backward.payload_bytes() - d_backward.payload_bytes("reduce"),
        }
        return out
    finally:
        os.environ.pop(SHARED_MEMORY_ENV, None)  # the worker processes serve the next tests too


def _expected_backward_events(owners: list[int], rank: int, world: int, ahead: int | None) -> list[str]:
    """Posting ahead, by its definition: at the first gradient the receives of the first `ahead` buckets (all of
    them without `ahead`), before bucket i is launched those up to i + `ahead`; a bucket the rank owns is world - 1
    receives, one it does not own one send (at its launch)."""
    events: list[str] = []
    posted = 0

    def post_to(end: int) -> None:
        nonlocal posted
        while posted < min(end, len(owners)):
            events.extend(["recv"] * (world - 1) if owners[posted] == rank else [])
            posted += 1

    ahead = len(owners) if ahead is None else ahead
    post_to(ahead)
    for index, owner in enumerate(owners):
        post_to(index + 1 + ahead)
        if owner != rank:
            events.append("send")
    return events


@pytest.mark.parametrize(
    "world, find_unused, ahead", [(2, False, None), (2, True, 2), (4, False, 2), (4, True, None)]
)  # every receive at the first gradient (the default), and receives_ahead=2
def test_socket_path_posts_receives_first_and_matches_ddp_in_values_and_bytes(world, find_unused, ahead):
    results = run_distributed(_against_ddp, world, find_unused, ahead, timeout=300.0)
    owners = results[0]["owners_in_launch_order"]
    # the case the fix is for: some owner sends a bucket before it receives one of its own
    assert any(owners[i] != owners[i + 1] for i in range(len(owners) - 1)), owners
    ddp_total = sum(r["bytes"]["ddp_sent"] for r in results)
    sdp_total = sum(r["bytes"]["sdp_sent"] for r in results)
    for rank, r in enumerate(results):
        assert r["param_diff"] <= TOL, (rank, r["param_diff"])
        assert r["grad_diff"] <= 1e-7, (rank, r["grad_diff"])
        b = r["bytes"]
        # every trainable gradient reduced once (plus, with find_unused, one count per parameter), every
        # trainable parameter broadcast once, nothing else on the sockets
        assert b["reduce_payload"] == b["trainable"] + b["users"], (rank, b)
        assert b["reduce_calls"] == b["buckets"], (rank, b)
        assert b["broadcast_payload"] == b["trainable"], (rank, b)
        assert b["other_payload"] == 0, (rank, b)
        for step, (backward, step_order) in enumerate(r["order"]):
            where = f"rank {rank}, step {step}"
            assert backward.count("recv") == (world - 1) * r["owned_buckets"], (where, backward)
            assert backward == _expected_backward_events(owners, rank, world, ahead), (where, backward)
            assert step_order.count("recv") == r["messages"] - r["owned_messages"], (where, step_order)
            last_recv = max((i for i, e in enumerate(step_order) if e == "recv"), default=-1)
            first_send = step_order.index("send") if "send" in step_order else len(step_order)
            assert last_recv < first_send, (where, "a receive posted after a send in the broadcast", step_order)
            assert step_order.count("send") == (world - 1) * r["owned_messages"], (where, step_order)
    # DDP's ring all-reduce sends 2 (N-1)/N of the gradients per rank; reduce + broadcast exactly the same
    trainable = results[0]["bytes"]["trainable"]
    assert ddp_total == pytest.approx(2 * (world - 1) * trainable)
    assert sdp_total == pytest.approx(ddp_total + (world - 1) * results[0]["bytes"]["users"])


def _mismatch(rank: int, world: int) -> str:
    posted = comm.post_reduce(4, torch.float32, 0, None)
    try:
        posted.start(torch.zeros(5))
    except ValueError as exc:
        message = str(exc)
    posted.start(torch.full((4,), float(rank + 1))).wait()  # the matching message completes it
    return message


def test_a_message_unlike_the_posted_one_is_refused_before_sending():
    for message in run_distributed(_mismatch, 2):
        assert "expected a contiguous tensor of 4 torch.float32 elements" in message and "got 5" in message


def _sums_by_path(rank: int, world: int) -> dict:
    """Each owner's averaged gradients over sockets and over shared memory, and every rank's local gradients
    (for the reference), on gradients whose float sum depends on its order (magnitudes 10**(3 rank))."""
    out: dict = {"local": None}
    for path, switch in (("sockets", "0"), ("shared_memory", "1")):
        os.environ[SHARED_MEMORY_ENV] = switch
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 512))
            opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, split_params=False)
            sdp = ShardedDataParallel(model, opt)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(8, 64, generator=g)
            scale = 10.0 ** (3 * rank)  # exact in fp32
            if out["local"] is None:  # the rank's own gradients, from a plain copy of the same model
                plain = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 512))
                plain.load_state_dict(model.state_dict())
                out["local"] = list(torch.autograd.grad(plain(x).sum() * scale, list(plain.parameters())))
            (sdp(x).sum() * scale).backward()
            out[path] = {i: p.grad.clone() for i, p in enumerate(model.parameters()) if opt.owner_of(p) == rank}
        finally:
            os.environ.pop(SHARED_MEMORY_ENV, None)
    return out


def test_sockets_and_shared_memory_give_the_same_sum_bit_for_bit():
    """The socket path and the shared-memory path promise the same sum bit for bit: the owner's own gradient,
    then every other rank's in rank order, then divided by N. The reference is that order, written here on the
    ranks' local gradients; the magnitudes make any other order differ in the last bits."""
    world = 4
    results = run_distributed(_sums_by_path, world, timeout=300.0)
    checked = 0
    for owner, r in enumerate(results):
        for index in r["sockets"]:
            expected = results[owner]["local"][index].clone()
            for other in range(world):
                if other != owner:
                    expected += results[other]["local"][index]
            expected /= world
            assert torch.equal(r["sockets"][index], expected), (owner, index)
            assert torch.equal(r["shared_memory"][index], expected), (owner, index)
            checked += 1
    assert checked == 4  # every parameter, each on its owner
