"""ShardedDataParallel + OSS against torch's DDP + the plain optimizer, on 2 and 4 gloo ranks."""

import glob
import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.nn import ShardedDataParallel, ShardedDDP
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed

TOL = 1e-6


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model, lr):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": lr * 3}]


def _batch(rank, step, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _clear(model, optimizer, how):
    if how == "model":
        model.zero_grad()
    elif how == "optimizer":
        optimizer.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=False)


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _parity(rank, world, name):
    """20 steps of SDP + OSS vs DDP + torch optimizer, for three ways of clearing grads and three bucket sizes."""
    cls, kwargs = OPTIMIZERS[name]
    results = {}
    for bucket in (0, 40, 2**23):
        for how in ("model", "optimizer", "set_to_none=False"):
            ref = _mlp()
            ref_opt = cls(_groups(ref, kwargs["lr"]), **kwargs)
            ddp = DDP(ref)
            model = _mlp()
            opt = OSS(_groups(model, kwargs["lr"]), optim=cls, **kwargs)
            sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
            scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (ref_opt, opt)]
            worst_grad = 0.0
            for step in range(20):
                x, y = _batch(rank, step)
                # this rank's own gradient, from the plain module outside DDP (no .grad touched)
                local = torch.autograd.grad(nn.functional.mse_loss(ref(x), y), list(ref.parameters()))
                for m, o, s in ((ddp, ref_opt, scheds[0]), (sdp, opt, scheds[1])):
                    _clear(m, o, how)
                    nn.functional.mse_loss(m(x), y).backward()
                    if m is sdp:  # owners hold DDP's gradient; the others their own for small parameters, or none
                        for p, q, mine in zip(model.parameters(), ref.parameters(), local, strict=True):
                            if opt.owner_of(p) == rank:
                                worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item())
                            elif p.numel() < min(bucket, 2**18):  # travels in a shared bucket: kept, as fairscale
                                worst_grad = max(worst_grad, (p.grad - mine).abs().max().item())
                            else:
                                assert p.grad is None
                    o.step()
                    s.step()
            results[(bucket, how)] = (_max_diff(ref, model), worst_grad)
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_parity_with_ddp(world, name):
    for rank_results in run_distributed(_parity, world, name):
        for case, (param_diff, grad_diff) in rank_results.items():
            assert param_diff < TOL, (case, param_diff)
            assert grad_diff < 1e-7, (case, grad_diff)


def _bytes_per_step(rank, world):
    """Per-step traffic of DDP (counted through a comm hook) and of SDP + OSS, with a frozen layer, with the
    parameters broadcast over gloo (as between hosts) and through shared memory (one host, the default)."""
    out = {}
    try:
        for transport, frozen in itertools.product(("0", "1"), (False, True)):
            os.environ[SHARED_MEMORY_ENV] = transport
            ref, model = _mlp(), _mlp()
            for m in (ref, model):
                m[2].weight.requires_grad_(not frozen)
            ddp = DDP(ref)
            ddp.register_comm_hook(None, counting_allreduce_hook)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
            sdp = ShardedDataParallel(model, opt, reduce_buffer_size=64)
            x, y = _batch(rank, 0)
            for _ in range(2):  # the second step is the steady state
                with comm_stats.measure() as d_ddp:
                    nn.functional.mse_loss(ddp(x), y).backward()
                    ref_opt.step()
                with comm_stats.measure() as d_sdp:
                    nn.functional.mse_loss(sdp(x), y).backward()
                    opt.step()
            trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
            out[transport, frozen] = {
                "ddp_sent": d_ddp.sent_bytes(),
                "ddp_payload": d_ddp.payload_bytes(),
                "sdp_sent": d_sdp.sent_bytes(),
                "reduce_payload": d_sdp.payload_bytes("reduce"),
                "broadcast_payload": d_sdp.payload_bytes("broadcast"),
                "shared_payload": d_sdp.payload_bytes("shared_memory"),
                "not_owned": sum(
                    p.numel() * 4 for p in model.parameters() if p.requires_grad and opt.owner_of(p) != rank
                ),
                "reduce_calls": d_sdp.calls("reduce"),
                "buckets": len(sdp._buckets),
                "trainable": trainable,
                "all_reduce_calls": d_sdp.calls("all_reduce"),
                "diff": _max_diff(ref, model),
                "files left": _segment_files_left(sdp, opt),
                # after backward nothing is in flight (gloo keeps unwaited sends; a destroyed group must find none)
                "signals pending": sdp._mailboxes.pending() if sdp._mailboxes else 0,
            }
    finally:
        os.environ.pop(SHARED_MEMORY_ENV, None)  # the worker processes serve the next tests too
    return out


def _segment_files_left(sdp, opt):
    """Shared-memory files of this SDP's mailboxes or OSS's messages still in /dev/shm (all ranks past steps)."""
    dist.barrier()
    tokens = [x.token for x in (getattr(sdp._mailboxes, "segments", None), opt._broadcaster._segments) if x]
    return [path for token in tokens for path in glob.glob(f"/dev/shm/ddpkit-{token}-*")]


@pytest.mark.parametrize("world", [2, 4])
def test_sends_no_more_than_ddp(world):
    results = run_distributed(_bytes_per_step, world)
    for transport, frozen in itertools.product(("0", "1"), (False, True)):
        case = f"{SHARED_MEMORY_ENV}={transport}, frozen={frozen}"
        per_rank = [result[transport, frozen] for result in results]
        for r in per_rank:
            assert r["diff"] <= TOL, (case, r["diff"])  # same parameters as DDP, either way
            assert not r["files left"], (case, r["files left"])
            assert r["signals pending"] == 0, (case, r["signals pending"])
            assert r["ddp_payload"] == r["trainable"], case  # DDP all-reduces every trainable gradient once
            assert r["all_reduce_calls"] == 0, case
            if transport == "0":
                assert r["reduce_payload"] == r["trainable"], case  # every trainable gradient reduced once
                assert r["reduce_calls"] == r["buckets"], case
                assert r["broadcast_payload"] == r["trainable"], case  # every trainable parameter broadcast once
                assert r["shared_payload"] == 0, case
            else:  # each rank copies into shared memory the gradients it does not own, and out of it those
                # parameters: a one-way copy of each, no sockets
                assert r["reduce_payload"] == r["broadcast_payload"] == 0, case
                assert r["shared_payload"] == 2 * r["not_owned"], case
        sdp_total = sum(r["sdp_sent"] for r in per_rank)
        ddp_total = sum(r["ddp_sent"] for r in per_rank)
        assert ddp_total == pytest.approx(2 * (world - 1) * per_rank[0]["trainable"]), case
        if transport == "0":
            # the wire carries the sum over ranks: a rank owning little sends more reduce and less broadcast
            # traffic; in all exactly DDP's bytes
            assert sdp_total == pytest.approx(ddp_total), case
            assert sdp_total <= ddp_total * (1 + 1e-12), case
        else:  # one host: only 1-byte signals on the wire, a "full" and an "added" per bucket and sender
            assert sdp_total == 2 * (world - 1) * per_rank[0]["buckets"], case


class _Routed(nn.Module):
    """`b` is used on rank 0 only, `c` on no rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, rank):
        y = self.a(x)
        return self.b(y) if rank == 0 else y


def _unused(rank, world):
    ref = DDP(_Routed(), find_unused_parameters=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    model = _Routed()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    sdp = ShardedDataParallel(model, opt, find_unused_parameters=True, reduce_buffer_size=8)
    for step in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        for m, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            m(x, rank).sum().backward()
            o.step()
        assert model.c.weight.grad is None and model.c.bias.grad is None
    # Two synced backwards without clearing: `b` used everywhere, then only on the ranks that do not own it. An
    # owner's untouched average must count once more (DDP: A + the new sum / N); a non-owner keeps only its new
    # gradient of a small (bucketed) parameter and drops the large one.
    # Then the other way round: `b` used only by its owner in the second backward, so a non-owner's kept gradient
    # of the first must not be sent again (it is dropped, and that rank holds none afterwards).
    owner_b = opt.owner_of(model.b.bias)
    owners = []
    for second_use in ("not_owner", "owner"):
        local = None
        for m, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            for k, use_b in enumerate((True, (rank != owner_b) == (second_use == "not_owner"))):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + 10 * k + rank))
                m(x, 0 if use_b else 1).sum().backward()
                if m is ref and k == 1 and use_b:
                    local = torch.autograd.grad(ref.module(x, 0).sum(), ref.module.b.bias)[0]
        owners += [
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            if opt.owner_of(p) == rank and q.grad is not None
        ]
        if rank != owner_b and local is not None:  # bucketed (4 elements < reduce_buffer_size 8): its new gradient
            owners.append((model.b.bias.grad - local).abs().max().item())
        elif rank != owner_b:
            assert model.b.bias.grad is None, second_use  # unused here: the stale kept gradient was dropped
        assert model.b.weight.grad is None or opt.owner_of(model.b.weight) == rank  # 16 elements: alone
    # without the flag: locally unused parameters still average exactly, and a warning says what happened
    routed = _Routed()
    plain = ShardedDataParallel(routed, OSS(routed.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain(torch.randn(2, 4), rank).sum().backward()
    return _max_diff(ref.module, model), max(owners), [str(w.message) for w in caught]


def test_unused_parameters_match_ddp():
    for diff, grad_diff, messages in run_distributed(_unused, 2):
        assert diff < TOL and grad_diff < 1e-6, (diff, grad_diff)
        assert any("find_unused_parameters=True" in m for m in messages)


def _accumulation(rank, world):
    """no_sync() accumulation then a synced backward, and no_sync() then a manual reduce()."""
    ref = DDP(_mlp())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, manual = _mlp(), _mlp()
    opt = OSS(model.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
    manual_opt = OSS(manual.parameters(), lr=0.1, momentum=0.9)
    manual_sdp = ShardedDataParallel(manual, manual_opt, reduce_buffer_size=100)
    for step in range(4):
        batches = [_batch(rank, 3 * step + k) for k in range(3)]
        for m, o in ((ref, ref_opt), (sdp, opt), (manual_sdp, manual_opt)):
            o.zero_grad()
            for k, (x, y) in enumerate(batches):
                last = k == len(batches) - 1 and m is not manual_sdp
                with m.no_sync() if not last else torch.enable_grad():
                    with comm_stats.measure() as d:
                        nn.functional.mse_loss(m(x), y).backward()
                    if not last and m is not ref:
                        assert d.calls() == 0  # nothing sent inside no_sync
            if m is manual_sdp:
                m.reduce()
            o.step()
    return _max_diff(ref.module, model), _max_diff(ref.module, manual)


def test_no_sync_accumulation_and_manual_reduce():
    for synced, manual in run_distributed(_accumulation, 2):
        assert synced < TOL and manual < TOL


class _WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _buffers(rank, world):
    model = _WithNorm()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) + rank
    sdp(x).sum().backward()  # buffers broadcast from rank 0 before the forward, then updated locally
    after_one = model.bn.running_mean.clone()
    with sdp.no_sync():
        sdp(x)
    inside_no_sync = model.bn.running_mean.clone()
    works = sdp.sync_buffers(blocking=False)
    for w in works:
        w.wait()
    return after_one, inside_no_sync, model.bn.running_mean.clone(), len(works)


def test_buffers_follow_rank_zero_outside_no_sync():
    results = run_distributed(_buffers, 2)
    (r0_one, r0_inside, r0_synced, n_works), (r1_one, r1_inside, r1_synced, _) = results
    assert not torch.allclose(r0_one, r1_one)  # each rank's forward updated its own statistics
    assert not torch.allclose(r0_inside, r1_inside)  # no broadcast inside no_sync
    assert n_works == 3  # running_mean, running_var, num_batches_tracked, each in place
    assert torch.equal(r0_synced, r0_inside) and torch.equal(r1_synced, r0_synced)


def _buffers_blocking(rank, world):
    model = _WithNorm()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    with torch.no_grad():
        model.bn.running_mean.fill_(float(rank + 1))
    sdp.sync_buffers(blocking=True)
    return model.bn.running_mean.clone()


def test_sync_buffers_blocking():
    a, b = run_distributed(_buffers_blocking, 2)
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.ones(4))


def _trainable_changes(rank, world):
    ref = DDP(_mlp())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    model = _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=50)
    messages = []
    for step in range(6):
        if step == 2:  # freeze a layer in both
            ref.module[0].weight.requires_grad_(False)
            model[0].weight.requires_grad_(False)
            ref = DDP(ref.module)  # torch's DDP must be rebuilt; ours refreshes itself
        if step == 4:
            ref.module[0].weight.requires_grad_(True)
            model[0].weight.requires_grad_(True)
            ref = DDP(ref.module)
        x, y = _batch(rank, step)
        for m, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                nn.functional.mse_loss(m(x), y).backward()
            messages += [str(w.message) for w in caught if m is sdp]
            o.step()
    return _max_diff(ref.module, model), messages


def test_auto_refresh_when_requires_grad_changes():
    for diff, messages in run_distributed(_trainable_changes, 2):
        assert diff < TOL
        assert sum("trainable parameters changed" in m for m in messages) == 2


def _fp16_reduce(rank, world):
    """(difference to DDP, fp16 bytes handed over, expected) over gloo, then through shared memory."""
    out = []
    try:
        for transport in ("0", "1"):
            os.environ[SHARED_MEMORY_ENV] = transport
            ref = DDP(_mlp())
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            model = _mlp()
            opt = OSS(model.parameters(), lr=0.1)
            sdp = ShardedDataParallel(model, opt, reduce_fp16=True, reduce_buffer_size=100)
            for step in range(5):
                x, y = _batch(rank, step)
                for m, o in ((ref, ref_opt), (sdp, opt)):
                    o.zero_grad()
                    with comm_stats.measure() as d:
                        nn.functional.mse_loss(m(x), y).backward()
                    o.step()
            if transport == "0":  # every rank hands every gradient to the reduce
                handed, expected = d.payload_bytes("reduce"), sum(p.numel() * 2 for p in model.parameters())
            else:  # each rank copies the gradients it does not own into its mailboxes
                handed = d.payload_bytes("shared_memory")
                expected = sum(p.numel() * 2 for p in model.parameters() if opt.owner_of(p) != rank)
            out.append((_max_diff(ref.module, model), handed, expected))
    finally:
        os.environ.pop(SHARED_MEMORY_ENV, None)
    return out


def test_reduce_fp16():
    for per_transport in run_distributed(_fp16_reduce, 2):
        for diff, handed, fp16_bytes in per_transport:
            assert diff < 1e-3
            assert handed == fp16_bytes  # half the bytes of fp32 gradients


def _api_and_errors(rank, world):
    model = _mlp()
    opt = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDDP(model, [opt])
    assert sdp.module is model
    model.custom_setting = 7
    assert sdp.custom_setting == 7  # attributes fall back to the wrapped module
    errors = {}
    for label, build in {
        "plain_optimizer": lambda: ShardedDataParallel(_mlp(), torch.optim.SGD(model.parameters(), lr=0.1)),
        "not_a_module": lambda: ShardedDataParallel("model", opt),
        "bad_buffer_size": lambda: ShardedDataParallel(_mlp(), OSS(_mlp().parameters(), lr=0.1), reduce_buffer_size=-1),
        "shared_params": lambda: ShardedDataParallel(model, [opt, OSS(model.parameters(), lr=0.1)]),
    }.items():
        try:
            build()
        except (TypeError, ValueError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    mixed = _mlp()
    mixed[0].weight = nn.Parameter(torch.empty(32, 8, device="meta"))
    try:
        ShardedDataParallel(mixed, OSS([p for p in mixed.parameters() if p.device.type == "cpu"], lr=0.1))
    except ValueError as exc:
        errors["mixed_devices"] = str(exc)
    # DDP's attributes, against torch's DDP on the same model
    ddp = DDP(_mlp())
    errors["attributes"] = repr((sdp.is_multi_device_module, sdp.device_type))
    errors["ddp_attributes"] = repr((ddp.is_multi_device_module, ddp.device_type))
    # a gradient that itself requires grad (create_graph=True): a RuntimeError, as torch's DDP raises
    for label, wrapped in (("sdp_create_graph", sdp), ("ddp_create_graph", ddp)):
        x, _ = _batch(rank, 0)
        try:
            wrapped(x).pow(2).sum().backward(create_graph=True)
        except RuntimeError as exc:
            errors[label] = str(exc)
    # a .grad that requires grad, set by hand (or a hook) after a clean backward: refused at the next forward, as
    # fairscale does (torch's DDP raises nothing there), naming the parameter
    fresh = _mlp()
    fresh_sdp = ShardedDataParallel(fresh, OSS(fresh.parameters(), lr=0.1))
    x, _ = _batch(rank, 0)
    fresh_sdp(x).sum().backward()
    fresh[0].weight.grad = fresh[0].weight.grad.detach().requires_grad_()
    try:
        fresh_sdp(x)
    except RuntimeError as exc:
        errors["grad_set_by_hand"] = str(exc)
    return errors


def test_api_and_clear_errors():
    errors = run_distributed(_api_and_errors, 2)[0]
    assert errors["attributes"] == errors["ddp_attributes"] == repr((False, "cpu"))
    assert "only works with gradients that do not require grad" in errors["sdp_create_graph"]
    assert "ddp_create_graph" in errors  # the reference raises too
    assert "the .grad of 0.weight does (set by hand or by a hook" in errors["grad_set_by_hand"]
    assert "must be a ddpkit.optim.OSS" in errors["plain_optimizer"] and "TypeError" in errors["plain_optimizer"]
    assert "torch.nn.Module" in errors["not_a_module"]
    assert "reduce_buffer_size" in errors["bad_buffer_size"]
    assert "share parameters" in errors["shared_params"]
    assert "several device types" in errors["mixed_devices"]


def _without_process_group(rank, world):
    try:
        OSS(_mlp().parameters(), lr=0.1)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_no_process_group_is_a_clear_error():
    for message in run_distributed(_without_process_group, 1, init=False):
        assert "init_process_group" in message


def _memory(rank, world):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=0)
    sdp(torch.randn(4, 64)).sum().backward()
    grad_elements = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    opt.step()
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    total = sum(p.numel() for p in model.parameters())
    return grad_elements, state, total, dist.get_world_size()


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_and_state_are_sharded(world):
    results = run_distributed(_memory, world)
    total = results[0][2]
    largest = 64 * 64
    assert sum(r[0] for r in results) == total  # each gradient lives on exactly one rank after backward
    for grads, state, _, n in results:
        assert grads <= total / n + largest
        assert state == 2 * grads  # Adam: two moments per owned element


def _two_backwards(rank, world):
    """Gradients accumulated over backwards that communicate (no no_sync, no zero_grad between) equal DDP's."""
    worst = {}
    patterns = (("sync", "sync"), ("sync", "no_sync", "sync"), ("no_sync", "sync", "sync"))
    cases = [(p, b, True) for p, b in itertools.product(patterns, (50, 2**23))]  # non-owners keep biases / all
    cases.append((("sync", "sync"), 2**23, False))  # keep_bucketed_grads=False: nothing kept
    for pattern, bucket, keep in cases:
        ref, model = _mlp(), _mlp()
        ddp = DDP(ref)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket, keep_bucketed_grads=keep)
        for i, mode in enumerate(pattern):
            x, y = _batch(rank, i)
            for m in (ddp, sdp):
                with m.no_sync() if mode == "no_sync" else torch.enable_grad():
                    nn.functional.mse_loss(m(x), y).backward()
        worst[pattern, bucket, keep] = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            if opt.owner_of(p) == rank
        )
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_accumulating_over_synced_backwards_matches_ddp(world):
    for worst in run_distributed(_two_backwards, world):
        for pattern, diff in worst.items():
            assert diff < 1e-6, (pattern, diff)


def _fairscale_defaults(rank, world):
    """zero_grad() with fairscale's default (zero in place) and to(dtype) on ShardedDataParallel, against DDP."""
    ref, model = _mlp().double(), _mlp()
    ddp, ref_opt = DDP(ref), torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sdp = ShardedDataParallel(model, opt)
    assert sdp.to(torch.float64) is sdp and sdp.to("cpu", non_blocking=True) is sdp  # dtype first: as dtype=
    assert all(p.dtype == torch.float64 for p in model.parameters())
    zeroed_in_place = []
    for step in range(4):
        x, y = _batch(rank, step)
        ddp.zero_grad()
        sdp.zero_grad()  # code written for fairscale: set_to_none=False
        zeroed_in_place.append(all(p.grad is None or not p.grad.any() for p in model.parameters()))
        zeroed_in_place[-1] &= step == 0 or any(p.grad is not None for p in model.parameters())
        for m, o in ((ddp, ref_opt), (sdp, opt)):
            nn.functional.mse_loss(m(x.double()), y.double()).backward()
            o.step()
    try:
        sdp.to("meta")
        error = ""
    except ValueError as exc:
        error = str(exc) if isinstance(exc, AssertionError) else "not an AssertionError, as fairscale raises"
    return _max_diff(ref, model), zeroed_in_place, error


@pytest.mark.parametrize("world", [2])
def test_fairscale_defaults_zero_grad_and_to(world):
    for diff, zeroed_in_place, error in run_distributed(_fairscale_defaults, world):
        assert diff < 1e-12 and all(zeroed_in_place), (diff, zeroed_in_place)
        assert "moving to meta is not supported" in error


def test_the_private_engine_check_is_verified_once_with_a_clear_fallback(monkeypatch):
    """ShardedDataParallel reads torch's private ``_will_engine_execute_node``; it is checked on a known graph, and
    when it is missing or answers otherwise, one warning says so and every backward counts as accumulating."""
    import ddpkit.nn.sharded_ddp as module

    monkeypatch.setattr(module, "_ENGINE_CHECK", [])
    assert module._engine_check() is torch._C._will_engine_execute_node  # this torch: the reading holds
    for replacement in (None, lambda node: True):  # missing; or never raising under autograd.grad
        monkeypatch.setattr(module, "_ENGINE_CHECK", [])
        if replacement is None:
            monkeypatch.delattr(torch._C, "_will_engine_execute_node")
        else:
            monkeypatch.setattr(torch._C, "_will_engine_execute_node", replacement, raising=False)
        with pytest.warns(UserWarning, match="does not tell whether a backward will accumulate"):
            assert module._engine_check() is None
        assert module._will_accumulate(object()) is True
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            module._engine_check()  # once: no second warning


def test_cross_host_compression_is_refused_where_it_would_be_ignored():
    """The compressed reduce between hosts runs over gloo on CPU tensors; on GPU parameters it would do nothing,
    so it is refused by name (checked before any collective; no GPU needed to check the rule)."""
    from ddpkit.nn.sharded_ddp import _check_compression

    with pytest.raises(ValueError, match=r"cross_host_compression='int8' compresses the CPU .* on cuda"):
        _check_compression("int8", {"cuda"})
    with pytest.raises(ValueError, match="must be one of"):
        _check_compression("int3", {"cpu"})
    _check_compression("int8", {"cpu"})
    _check_compression("none", {"cuda"})
