"""Large parameters cut over the ranks (`OSS(split_params=...)`): the same training as torch DDP + Adam, the
optimizer state per rank down to about 1/N of the model, the same bytes as without cutting, and checkpoints in
torch's whole-parameter format.

The model is dominated by one 1023x1031 weight (1.05M elements, 96% of the parameters, an odd count so that the
pieces differ in size), so without cutting one rank would hold almost all of the Adam state.
"""

import itertools
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import comm_stats, counting_allreduce_hook
from ddpkit.distributed.shared_memory import ENV_VAR as SHARED_MEMORY_ENV
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, ShardedGradScaler, reduce_to_owners_hook
from ddpkit.testing import run_distributed

TOL = 1e-5  # at 4 ranks the sum order alone (reduce vs ring) moves Adam parameters by 2.7e-6, cut or not
STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 1023), nn.Tanh(), nn.Linear(1023, 1031), nn.Tanh(), nn.Linear(1031, 3))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _train(rank: int, mode: str) -> dict:
    """`mode`: "oss_ddp" (OSS + torch DDP), "oss_hook" (the same with `reduce_to_owners_hook`), "sdp"
    (ShardedDataParallel over sockets), "sdp_shm" (shared memory)."""
    ref, model = _model(), _model()
    ddp = DDP(ref)
    ddp.register_comm_hook(None, counting_allreduce_hook)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, weight_decay=0.01)
    if mode == "oss_ddp":
        wrapped = DDP(model)
        wrapped.register_comm_hook(None, counting_allreduce_hook)
    elif mode == "oss_hook":
        wrapped = DDP(model)
        wrapped.register_comm_hook(opt, reduce_to_owners_hook)
    else:
        wrapped = ShardedDataParallel(model, opt)
    out: dict = {"norm_diff": 0.0}
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad()
        if step == 2:  # a second backward before the step, gradients not cleared in between (accumulation)
            _loss(ddp, rank, 99).backward()
            if mode == "oss_hook":  # owners only hold the averages: accumulate locally, as the hook's doc says
                with wrapped.no_sync():
                    _loss(wrapped, rank, 99).backward()
            else:
                _loss(wrapped, rank, 99).backward()
        with comm_stats.measure() as d_ddp:
            _loss(ddp, rank, step).backward()
        with comm_stats.measure() as d_backward:
            _loss(wrapped, rank, step).backward()
        if step == 1:  # global-norm clipping over the pieces equals torch's over the whole model
            ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            norm = opt.clip_grad_norm(0.05)
            out["norm_diff"] = abs(float(norm) - float(ref_norm)) / float(ref_norm)
        with comm_stats.measure() as d_step:
            opt.step()
        ref_opt.step()
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    out["param_diff"] = max((p - q).abs().max().item() for p, q in pairs)
    big = model[2].weight
    out["pieces"] = [(piece.owner, piece.start, piece.end) for piece in opt.pieces_of(big)]
    out["owner_of_big"] = opt.owner_of(big)
    out["state_bytes"] = _state_bytes(opt)
    out["ref_state_bytes"] = _state_bytes(ref_opt)
    out["ddp_sent"] = d_ddp.sent_bytes()
    out["sent"] = d_backward.sent_bytes() + d_step.sent_bytes()
    out["broadcast_payload"] = d_step.payload_bytes("broadcast")
    out["trainable_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    # checkpoints: torch's format, equal to torch's Adam state; loading torch's state continues identically
    saved = opt.state_dict(all_ranks=True)
    theirs = ref_opt.state_dict()
    out["state_dict_diff"] = max(
        (saved["state"][i][k].float() - theirs["state"][i][k].float()).abs().max().item()
        for i in theirs["state"]
        for k in theirs["state"][i]
    )
    out["state_dict_shapes"] = all(
        saved["state"][i][k].shape == theirs["state"][i][k].shape for i in theirs["state"] for k in theirs["state"][i]
    )
    fresh_opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, weight_decay=0.01)
    fresh_opt.load_state_dict(theirs)
    for o in (fresh_opt, ref_opt):
        o.zero_grad()
    _loss(ddp, rank, 7).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):  # the reference's averaged gradients
        p.grad = q.grad.clone()
    fresh_opt.step()
    ref_opt.step()
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    out["resumed_diff"] = max((p - q).abs().max().item() for p, q in pairs)
    return out


def _run(rank: int, world: int, modes: list[str]) -> dict:
    results = {}
    for mode in modes:
        os.environ[SHARED_MEMORY_ENV] = "1" if mode == "sdp_shm" else "0"
        try:
            results[mode] = _train(rank, mode)
        finally:
            os.environ.pop(SHARED_MEMORY_ENV, None)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_split_parameter_trains_like_ddp_with_state_and_bytes_per_rank(world):
    modes = ["oss_ddp", "oss_hook", "sdp", "sdp_shm"] if world == 2 else ["oss_hook", "sdp", "sdp_shm"]
    results = run_distributed(_run, world, modes, timeout=300.0)
    numel = 1023 * 1031
    for mode in modes:
        for rank, by_mode in enumerate(results):
            r, where = by_mode[mode], (mode, rank)
            assert r["param_diff"] <= TOL, (where, r["param_diff"])
            assert r["norm_diff"] <= 1e-5, (where, r["norm_diff"])
            assert r["owner_of_big"] is None, where
            spans = [(start, end) for _, start, end in r["pieces"]]
            assert [owner for owner, _, _ in r["pieces"]] == list(range(world)), where
            assert spans[0][0] == 0 and spans[-1][1] == numel, where
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), where
            assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1, where
            # Adam's two moments: about 1/N of the model's per rank (goal: within 10% of a perfect split)
            assert r["state_bytes"] <= 1.1 * r["ref_state_bytes"] / world, (where, r["state_bytes"])
            assert r["state_dict_shapes"] and r["state_dict_diff"] <= 1e-6, (where, r["state_dict_diff"])
            assert r["resumed_diff"] <= TOL, (where, r["resumed_diff"])
        total = sum(by_mode[mode]["sent"] for by_mode in results)
        ddp_total = sum(by_mode[mode]["ddp_sent"] for by_mode in results)
        trainable = results[0][mode]["trainable_bytes"]
        if mode in ("sdp", "oss_hook"):  # reduce to the owners + broadcast from them: exactly DDP's ring all-reduce
            assert total == pytest.approx(ddp_total), mode
        if mode == "oss_ddp":  # DDP's all-reduce plus every parameter broadcast once by its owner(s)
            assert total == pytest.approx(ddp_total + (world - 1) * trainable), mode
        if mode != "sdp_shm":
            assert sum(by_mode[mode]["broadcast_payload"] for by_mode in results) == world * trainable, mode


def _held_piece_gradients(rank: int, world: int) -> dict:
    """After ShardedDataParallel's backward a cut parameter's gradient is its piece only, equal to DDP's average
    there; ShardedGradScaler unscales and checks it; `full_split_grads=True` keeps the full-size tensor."""
    out: dict = {}
    for shared_memory, full in ((False, False), (True, False), (False, True)):
        os.environ[SHARED_MEMORY_ENV] = "1" if shared_memory else "0"
        try:
            ref, model = _model(), _model()
            ddp = DDP(ref)
            opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
            sdp = ShardedDataParallel(model, opt, full_split_grads=full)
            scaler = ShardedGradScaler(init_scale=1024.0, device="cpu")
            big, big_ref = model[2].weight, ref[2].weight
            piece = opt.pieces_of(big)[rank]
            case: dict = {}
            for step in range(2):
                sdp.zero_grad(set_to_none=True)
                case[f"cleared_{step}"] = piece.tensor.grad is None and big.grad is None
                ddp.zero_grad(set_to_none=True)
                _loss(ddp, rank, step).backward()
                scaler.scale(_loss(sdp, rank, step)).backward()
                average = big_ref.grad.reshape(-1)[piece.start : piece.end]
                if full:
                    case["full_shape"] = big.grad is not None and big.grad.shape == big.shape
                    held = big.grad.reshape(-1)[piece.start : piece.end]
                else:
                    case["grad_let_go"] = big.grad is None
                    held = piece.tensor.grad
                    case["held_numel"] = held.numel()
                if step == 0:  # (the reference does not step)
                    case["scaled_diff"] = (held / 1024.0 - average).abs().max().item()
                if step == 1 and rank == world - 1:
                    held[0] = float("inf")  # only this rank's piece overflows: every rank must skip
                before = [p.detach().clone() for p in model.parameters()]
                scaler.unscale_(opt)
                if step == 0:
                    case["unscaled_diff"] = (held - average).abs().max().item()
                scaler.step(opt)
                scaler.update()
                moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                case[f"moved_{step}"] = moved
            case["scale"] = scaler.get_scale()
            case["piece_numel"] = piece.end - piece.start
            out[(shared_memory, full)] = case
        finally:
            os.environ.pop(SHARED_MEMORY_ENV, None)
    return out


def test_a_split_parameter_keeps_only_its_piece_of_the_gradient():
    for rank, by_case in enumerate(run_distributed(_held_piece_gradients, 2)):
        for (shared_memory, full), r in by_case.items():
            where = (rank, shared_memory, full, r)
            assert r["cleared_0"] and r["cleared_1"], where
            assert r["scaled_diff"] <= 1e-6 and r["unscaled_diff"] <= 1e-6, where
            assert r["moved_0"] and not r["moved_1"], where  # the second step skipped on every rank
            assert r["scale"] == 512.0, where  # 1024 kept after the first step, halved after the skipped one
            if full:
                assert r["full_shape"], where
            else:
                assert r["grad_let_go"] and r["held_numel"] == r["piece_numel"] < 1023 * 1031, where


def _choices(rank: int, world: int) -> dict:
    model = _model()
    out = {}
    kept = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, split_params=False)
    out["false_keeps_owners"] = all(kept.owner_of(p) is not None for p in model.parameters())
    out["false_no_pieces"] = not any(kept.pieces_of(p) for p in model.parameters())
    small = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 3))
    auto_small = OSS(small.parameters(), optim=torch.optim.Adam, lr=1e-3)
    out["small_not_cut"] = not any(auto_small.pieces_of(p) for p in small.parameters())
    # min_split_numel: a small model dominated by one tensor (512 of 771 elements) is cut where it pays, to 1/N
    lowered = OSS(small.parameters(), optim=torch.optim.Adam, lr=1e-3, min_split_numel=100)
    small(torch.randn(2, 8)).sum().backward()
    lowered.step()
    out["lowered_cut"] = [bool(lowered.pieces_of(p)) for p in small.parameters()]
    out["lowered_state"] = _state_bytes(lowered.optim)
    out["lowered_total"] = 2 * 4 * sum(p.numel() for p in small.parameters())  # Adam's two fp32 moments
    # a closure (Lightning steps this way): the pieces must get the gradients it computes. Same data on both
    # ranks, so the reference is plain Adam on this process.
    torch.manual_seed(3)
    net, ref = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 3)), nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 3))
    ref.load_state_dict(net.state_dict())
    by_closure = OSS(net.parameters(), optim=torch.optim.Adam, lr=0.01, min_split_numel=100)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))

    def closure(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = module(x).square().mean()
        loss.backward()
        return loss

    for _ in range(3):
        losses = [opt.step(lambda m=m, o=opt: closure(m, o)) for m, opt in ((net, by_closure), (ref, ref_opt))]
    out["closure_cut"] = bool(by_closure.pieces_of(net[0].weight))
    out["closure_loss"] = float(losses[0] - losses[1])
    out["closure_diff"] = max(
        (a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters(), strict=True)
    )
    single = nn.Parameter(torch.ones(1))  # fewer elements than ranks: never cut (a rank would get an empty piece)
    out["single_whole"] = not OSS([single], optim=torch.optim.Adam, lr=1e-3, min_split_numel=1).pieces_of(single)
    out["bad_min_split"] = []
    for bad in (0, 1.5, True):
        try:
            OSS(small.parameters(), optim=torch.optim.Adam, lr=1e-3, min_split_numel=bad)
            out["bad_min_split"].append("accepted")
        except (TypeError, ValueError) as exc:
            out["bad_min_split"].append(f"{type(exc).__name__}: {exc}")
    for name, kwargs in [
        ("non_elementwise", {"optim": torch.optim.LBFGS, "split_params": True}),
        ("bad_value", {"optim": torch.optim.Adam, "split_params": "yes"}),
    ]:
        try:
            OSS(model.parameters(), lr=1e-3, **kwargs)
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    auto_lbfgs = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-3)
    out["sgd_cut"] = bool(auto_lbfgs.pieces_of(model[2].weight))
    return out


def test_split_params_choices_and_refusals():
    for r in run_distributed(_choices, 2):
        assert r["false_keeps_owners"] and r["false_no_pieces"]
        assert r["small_not_cut"] and r["sgd_cut"]
        assert r["lowered_cut"] == [True, False, True, False], r["lowered_cut"]  # the two weights, largest first
        assert r["lowered_state"] <= 1.1 * r["lowered_total"] / 2, (r["lowered_state"], r["lowered_total"])
        assert r["bad_min_split"][0].startswith("ValueError: OSS: min_split_numel must be an int >= 1")
        assert all(m.startswith("TypeError: OSS: min_split_numel must be an int") for m in r["bad_min_split"][1:])
        assert r["single_whole"]
        assert r["closure_cut"] and abs(r["closure_loss"]) < 1e-6 and r["closure_diff"] < 1e-6, r
        assert "split_params=True needs an element-wise optimizer" in r["non_elementwise"], r
        assert "LBFGS" in r["non_elementwise"]
        assert "split_params must be None" in r["bad_value"], r


def test_choose_splits_cuts_largest_first_until_balanced():
    from ddpkit.optim.partition import choose_splits, even_spans

    assert even_spans(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_spans(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    # already within 10% of a perfect split: nothing is cut
    assert choose_splits([50, 50, 49, 51], [True] * 4, 2, 0.1) == set()
    # one dominant item: cut it (and only it) -- 2 ranks: max(100/2 + 10, 100/2) = 60 <= 1.1 * 120 / 2 = 66
    assert choose_splits([100, 10, 10], [True] * 3, 2, 0.1) == {0}
    # not a candidate (e.g. a non-element-wise optimizer): left whole even if unbalanced
    assert choose_splits([100, 10, 10], [False, True, True], 2, 0.1) == set()
    # two large items at 4 ranks: the largest first, then the next until balanced
    assert choose_splits([400, 300, 10, 10], [True] * 4, 4, 0.1) == {0, 1}
    # balance out of reach: the count of cuts that leaves the smallest maximum (no useless cuts of small items)
    assert choose_splits([100, 10, 10], [False, True, True], 2, 0.1) == set()
    assert choose_splits([100, 60, 60], [True, False, False], 4, 0.1) == {0}  # 100 -> 85, the limit 60.5 unreachable
    assert choose_splits([100, 90, 5], [True, False, False], 4, 0.1) == set()  # cutting would raise 100 to 115
