"""Public behaviours fairscale users rely on, each against its reference value.

References: OSS's state dict must carry `OSS.param_groups` key for key (fairscale syncs its param groups from the
optimizer it wraps and saves those), before and after a load; a scheduler's current values must be in a consolidated
state dict; `add_param_group` must put every new tensor, a frozen one too, in exactly one rank's optimizer (the union
over the ranks is the group, no overlap: fairscale's test_add_param_group counts the elements each rank holds), and a
frozen one made trainable in its owner's only; AdaScale on one worker without accumulation is refused with a
RuntimeError, as fairscale's test_single_node_adascale expects; `AdaScale.unhook()` must let the parameters go by
reference counting alone (fairscale checks that the tensor is freed once model and optimizer are deleted); AdaScale
around OSS, in either of fairscale's spellings, must give the gain and mean weight fairscale's test_oss_adascale
recorded for its four-layer model after two steps on two ranks (1.0335265132125744 and 52.92657661437988, the values of
plain AdaScale over DDP). OSS around AdaScale (``OSS(params, AdaScaleWrapper, optim_cls=SGD)``) must give the same: its
AdaScale measures the whole model (fairscale's measured each rank's shard and recorded 94.93 there). After a
ShardedDataParallel backward, code that reads `p.grad` on every rank (fairscale's test_train_eval_change reads the first
parameter's gradient on each rank and takes its norm) must find a tensor for the small parameters fairscale keeps in its
buckets: the owner DDP's average, the others their own gradient (from the plain module, outside any wrapper);
`keep_bucketed_grads=False` drops them, a memory saving of exactly those elements.
"""

from __future__ import annotations

import gc
import weakref
from statistics import mean

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper
from ddpkit.testing import run_distributed


def _without_params(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _oss_behaviours(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    held = optimizer._per_device_params  # fairscale's private views, read by its test_gradient_clipping and
    out = {  # test_reproducibility
        "per device": [[id(t) for t in tensors] for tensors in held[torch.device("cpu")]] if len(held) == 1 else held,
        "partition": [[id(t) for g in groups for t in g["params"]] for groups in optimizer.partition_parameters()],
        "buckets": sorted(
            (str(d), owner, m.buffer.dtype) for d, by in optimizer.buckets.items() for owner, m in by.items()
        ),
    }
    scheduler.step()
    optimizer.consolidate_state_dict(recipient_rank=-1)
    saved = optimizer.state_dict()
    out |= {"saved": _without_params(saved["param_groups"]), "before": _without_params(optimizer.param_groups)}
    optimizer.load_state_dict(saved)
    optimizer.consolidate_state_dict(recipient_rank=-1)
    out["after"] = _without_params(optimizer.param_groups)
    out["resaved"] = _without_params(optimizer.state_dict()["param_groups"])
    extra = [nn.Parameter(torch.randn(n)) for n in (5, 7, 3, 11)] + [torch.rand(3, 1)]  # the last one frozen
    optimizer.add_param_group({"params": extra, "lr": 0.01})
    out["owned"] = _held(optimizer, extra)
    out["new_group_lr"] = optimizer.param_groups[-1]["lr"]
    extra[-1].requires_grad_(True)
    optimizer.refresh_trainable()
    out["owned once trainable"] = _held(optimizer, extra)
    out["owner once trainable"] = optimizer.owner_of(extra[-1])
    # a frozen tensor at the front of a model is held by rank 0, as fairscale's in-order partition places it
    # (fairscale's test_step scales every tensor a rank's optimizer holds by 1 + rank / 10, and it is never sent)
    front_frozen = [torch.randn(3, 2), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(6))]
    placed = OSS(front_frozen, optim=torch.optim.SGD, lr=0.1)
    out["front frozen held"] = _held(placed, front_frozen)
    return out


def _held(optimizer: OSS, tensors: list[torch.Tensor]) -> list[int]:
    """The indices of `tensors` that this rank's local optimizer holds."""
    mine = [id(p) for group in optimizer.optim.param_groups for p in group["params"]]
    return [i for i, p in enumerate(tensors) for _ in range(mine.count(id(p)))]


def test_oss_state_dict_param_groups_are_oss_param_groups_and_new_groups_are_partitioned():
    results = run_distributed(_oss_behaviours, 2)
    for rank, r in enumerate(results):
        assert r["saved"] == r["before"], rank  # key for key, including the fused kernel OSS chose
        assert r["before"][0]["fused"] is True and r["before"][0]["lr"] == pytest.approx(0.05), r["before"]
        assert r["after"] == r["before"] and r["resaved"] == r["before"], rank
        assert r["new_group_lr"] == 0.01
    for r in results:
        assert r["per device"] == r["partition"], r
        assert r["buckets"] == [("cpu", 0, torch.float32), ("cpu", 1, torch.float32)], r["buckets"]
    for key in ("owned", "owned once trainable"):  # every tensor in one rank's optimizer, frozen too (fairscale's)
        owned = sorted(i for r in results for i in r[key])
        assert owned == [0, 1, 2, 3, 4] and all(r[key] for r in results), [r[key] for r in results]
    assert [0 in r["front frozen held"] for r in results] == [True, False], results
    holder = [rank for rank, r in enumerate(results) if 4 in r["owned once trainable"]]
    assert holder == [results[0]["owner once trainable"]] == [results[1]["owner once trainable"]], results


def test_adascale_on_one_worker_without_accumulation_is_a_runtime_error_as_in_fairscale():
    model = nn.Linear(2, 2, bias=False)
    with pytest.raises(RuntimeError, match="single worker without gradient accumulation"):
        AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
    with pytest.raises(RuntimeError, match="a single worker needs num_gradients_to_accumulate >= 2"):
        optimizer.set_num_gradients_to_accumulate(1)


def test_adascale_unhook_lets_the_parameters_go():
    def parameter_left_after(unhook: bool) -> bool:
        model = nn.Linear(123, 456, bias=False)
        optimizer = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=2)
        model(torch.randn(2, 123)).sum().backward()
        weight = weakref.ref(model.weight)
        if unhook:
            optimizer.unhook()
        del model, optimizer
        return weight() is not None

    gc.collect()
    gc.disable()  # reference counting only: what unhook releases goes at once, without a collection
    try:
        assert not parameter_left_after(unhook=True)
    finally:
        gc.enable()


def test_adascale_hook_handles_count_the_hooked_parameters_as_fairscales_tests_read_them():
    """fairscale's test_add_param_group counts `_hook_handles`: one per trainable parameter, groups added later too."""
    optimizer = AdaScale(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), num_gradients_to_accumulate=2)
    counts = [len(optimizer._hook_handles)]
    optimizer.add_param_group({"params": nn.Linear(2, 3).parameters()})
    counts.append(len(optimizer._hook_handles))
    optimizer.unhook()
    assert [*counts, len(optimizer._hook_handles)] == [2, 4, 0]


def _adascale_around_oss(rank: int, world_size: int, spelling: str) -> tuple[float, float]:
    sizes = [(3, 2), (4, 3), (5, 4), (6, 5)]
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for o, i in sizes))
    with torch.no_grad():
        for layer, (o, i) in zip(model, sizes, strict=True):
            layer.weight.copy_(torch.arange(o * i, dtype=torch.float32).reshape(o, i) / mean(range(o * i)))
    model = DDP(model)
    if spelling == "AdaScale(OSS(...))":
        optimizer = AdaScale(OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    elif spelling == "AdaScaleWrapper(optim_cls=OSS)":
        optimizer = AdaScaleWrapper(model.parameters(), optim_cls=OSS, optim=torch.optim.SGD, lr=0.1)
    elif spelling == "OSS(AdaScaleWrapper)":  # the AdaScale inside: measures the whole model, not its shard
        sharded = OSS(model.parameters(), AdaScaleWrapper, optim_cls=torch.optim.SGD, lr=0.1)
        optimizer = sharded
        optimizer.gain = sharded.optim.gain  # type: ignore[method-assign]
    else:
        optimizer = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))
    for inputs in ([[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]):
        model(torch.tensor(inputs[rank])).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer.gain(), mean(layer.weight.mean().item() for layer in model.module)


@pytest.mark.parametrize(
    "spelling", ["AdaScale(SGD)", "AdaScale(OSS(...))", "AdaScaleWrapper(optim_cls=OSS)", "OSS(AdaScaleWrapper)"]
)
def test_adascale_around_oss_gives_fairscales_recorded_sequence(spelling):
    for gain, mean_weight in run_distributed(_adascale_around_oss, 2, spelling):
        assert gain == pytest.approx(1.0335265132125744, rel=1e-6)
        assert mean_weight == pytest.approx(52.92657661437988, rel=1e-6)


def _grads_after_backward(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    x = torch.rand(2, 2, generator=torch.Generator().manual_seed(rank))
    ddp = DDP(ref)
    ddp(x).sum().backward()
    averaged = [p.grad.clone() for p in ref.parameters()]
    local = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
    out: dict = {}
    for keep in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-3, momentum=0.99)
        sdp = ShardedDataParallel(model, optimizer, keep_bucketed_grads=keep)
        sdp(x).sum().backward()
        sdp.zero_grad()  # fairscale's test: wipe, evaluate, train again
        sdp.eval()
        sdp(x)
        first = next(sdp.parameters()).grad
        out[keep, "eval"] = first is None or torch.norm(first).item() < 1e-6
        sdp.train()
        sdp(x).sum().backward()
        grads = [p.grad for p in model.parameters()]
        owned = [optimizer.owner_of(p) == rank for p in model.parameters()]
        out[keep, "norm"] = None if grads[0] is None else torch.norm(grads[0]).item()
        out[keep, "off"] = max(
            (g - (a if mine else own)).abs().max().item()
            for g, a, own, mine in zip(grads, averaged, local, owned, strict=True)
            if g is not None
        )
        out[keep, "missing"] = [i for i, (g, mine) in enumerate(zip(grads, owned, strict=True)) if g is None]
        out[keep, "owned"] = [i for i, mine in enumerate(owned) if mine]
        # torch.autograd.grad through the wrapper (a gradient penalty) returns the plain local gradients and leaves
        # every .grad as it was
        before = [None if g is None else g.clone() for g in grads]
        taken = torch.autograd.grad(sdp(x).sum(), list(model.parameters()))
        out[keep, "autograd_off"] = max((t - o).abs().max().item() for t, o in zip(taken, local, strict=True))
        out[keep, "grads_kept"] = all(
            (a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
            for a, p in zip(before, model.parameters(), strict=True)
        )
    try:
        ShardedDataParallel(model, optimizer, keep_bucketed_grads="yes")  # type: ignore[arg-type]
        out["bad_keep"] = "accepted"
    except TypeError as exc:
        out["bad_keep"] = str(exc)
    return out


def test_every_rank_reads_a_gradient_after_sharded_backward_as_in_fairscale():
    for rank, r in enumerate(run_distributed(_grads_after_backward, 2)):
        assert r[True, "eval"] and r[False, "eval"], rank
        assert r[True, "norm"] is not None and r[True, "norm"] > 0.0, rank  # fairscale's assertion, on every rank
        assert r[True, "missing"] == [], rank
        assert r[True, "off"] < 1e-6 and r[False, "off"] < 1e-6, (rank, r)
        assert r[False, "missing"] == [i for i in range(6) if i not in r[False, "owned"]], rank
        for keep in (True, False):
            assert r[keep, "autograd_off"] < 1e-6 and r[keep, "grads_kept"], (rank, keep, r[keep, "autograd_off"])
        assert "keep_bucketed_grads must be True or False" in r["bad_keep"], r["bad_keep"]
