"""DiLoCo's pseudo-gradient sync (int8 with error feedback, in fragments) under `ddpkit train --fault-tolerant`.

In one process: each rank is a thread running the `Trainer` with `FaultTolerantSync`, the callback the command
runs (its `OuterSchedule` carrying the `OuterSyncSettings` the command builds from --slowmo-compression and
--slowmo-fragments), meeting the others in a HashStore. The reference is written apart from the code under test:
each rank's own AdamW steps, and at each sync of a fragment the arithmetic of the compressed mean done here
(every rank's ``dequantize(quantize(d))``, their fp32 mean quantised again), the residual ``d - sent`` and
Nesterov's outer step, then x = g; the job's last round an exact mean.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.quantize import dequantize, quantize
from ddpkit.algorithms.slow_momentum import SlowMoRule
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.train.loop.fault_tolerant_sync import FaultTolerantSync, OuterSchedule
from ddpkit.train.loop.trainer import Trainer

LR, BETA, ALPHA, STEPS, BATCH, BLOCK = 0.01, 0.9, 0.7, 8, 6, 8
SETTINGS = OuterSyncSettings(compression="int8", block=BLOCK, error_feedback=True, fragments=2)
# H = 4, K = 2: fragment 0 (parameters [0, 32)) syncs after steps 2 and 6, fragment 1 ([32, 67)) after 4 and 8;
# every sync is a slow step (slow_every 4): rounds 1..4 at steps 2, 4, 6, 8, round 5 the last (exact) one
FRAGMENTS, SYNC_STEPS = [(0, 32), (32, 67)], {2: 0, 4: 1, 6: 0, 8: 1}
SEEDING = threading.Lock()


def _model(seed: int) -> nn.Module:
    with SEEDING:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(rank: int, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + rank)
    return torch.randn(steps * BATCH, 4, generator=g), torch.randint(0, 3, (steps * BATCH,), generator=g)


def _schedule() -> OuterSchedule:
    return OuterSchedule(every=4, slow_every=4, rule=SlowMoRule(BETA, ALPHA, nesterov=True), sync=SETTINGS)


class _Recorder:
    def annotate_last(self, **columns: Any) -> None:
        pass


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        nn.utils.vector_to_parameters(flat, model.parameters())


def _held(sync: FaultTolerantSync, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """A copy of what a round may change: the parameters (`flat`, the round's), g, the residual, x0 and u."""
    assert sync.pseudo is not None and sync.slow is not None
    outer = sync.pseudo.outer
    assert outer.residual is not None and sync.slow.x0 is not None and sync.slow.u is not None
    return {
        "params": flat.clone(),
        "synced": outer.synced.clone(),
        "residual": outer.residual.clone(),
        "x0": sync.slow.x0.clone(),
        "u": sync.slow.u.clone(),
    }


def _rank(store: Any, rank: int, fail_round: int, out: dict) -> None:
    model = _model(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    manager = Manager(store, rank, 2, quorum_timeout=1.0, start_timeout=20, report=None)
    sync = FaultTolerantSync(manager, model, optimizer, _Recorder(), STEPS, _schedule())  # type: ignore[arg-type]
    assert sync.pseudo is not None
    rounds: dict[int, dict[str, Any]] = {}
    real_collective, real_run = manager.collective, sync.pseudo.run

    def collective(work: Any, flat: torch.Tensor, *args: Any) -> Any:  # the round's work, before its commit
        result = real_collective(work, flat, *args)
        if manager.current().round in rounds:  # (not the last round's exact average)
            rounds[manager.current().round]["worked"] = _held(sync, flat)
        if rank == 1 and manager.current().round == fail_round:
            manager.fail()  # this rank's round fails after its work: every member must drop it
        return result

    def run(flat: torch.Tensor, step: int, lr: float) -> bool:
        rounds[manager.current().round] = {"before": _held(sync, flat)}
        committed = real_run(flat, step, lr)
        rounds[manager.current().round] |= {"after": _held(sync, flat), "committed": committed}
        return committed

    manager.collective, sync.pseudo.run = collective, run  # type: ignore[method-assign]
    loader = DataLoader(TensorDataset(*_data(rank)), batch_size=BATCH, shuffle=False)
    trainer = Trainer(model, optimizer, loader, callbacks=[sync])
    trainer.fit(epochs=1)
    sync.finish(trainer)
    out[rank] = (_flat(model), rounds)
    manager.close()


def _in_threads(work: Any, ranks: int, *args: Any) -> dict:
    """`work(store, rank, *args, out)` for each rank, one thread each, meeting in one HashStore; their `out`."""
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=work, args=(store, r, *args, out), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120  # for them all
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert sorted(out) == list(range(ranks)), "a rank failed or hung"
    return out


def _train(fail_round: int = -1) -> dict:
    return _in_threads(_rank, 2, fail_round)


def _qd(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, "int8", BLOCK))


def _reference(dropped: int | None = None) -> torch.Tensor:
    """Both ranks' final parameters: AdamW's local steps from rank 0's model, DiLoCo's compressed syncs (module
    doc) at `SYNC_STEPS` except the one after step `dropped` (a failed round changes nothing), an exact mean."""
    models = [_model(0), _model(0)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    g, x0 = _flat(models[0]), _flat(models[0])
    u = torch.zeros_like(g)
    residuals = [torch.zeros_like(g), torch.zeros_like(g)]
    for step in range(1, STEPS + 1):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            x, y = (t[(step - 1) * BATCH : step * BATCH] for t in _data(rank))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        if step not in SYNC_STEPS or step == dropped:
            continue
        a, b = FRAGMENTS[SYNC_STEPS[step]]
        ds = [g[a:b] - _flat(m)[a:b] + e[a:b] for m, e in zip(models, residuals, strict=True)]
        sent = [_qd(d) for d in ds]
        for e, d, s in zip(residuals, ds, sent, strict=True):
            e[a:b] = d - s
        g[a:b] -= _qd((sent[0] + sent[1]) / 2)
        delta = (x0[a:b] - g[a:b]) / LR  # Nesterov's outer step, SlowMo's form
        u[a:b] = BETA * u[a:b] + delta
        x0[a:b] -= ALPHA * LR * (delta + BETA * u[a:b])
        g[a:b] = x0[a:b]
        for model in models:
            x = _flat(model)
            x[a:b] = g[a:b]
            _load(model, x)
    return (_flat(models[0]) + _flat(models[1])) / 2


def test_fault_tolerant_diloco_int8_in_fragments_equals_the_compressed_arithmetic():
    out = _train()
    assert [(r, v["committed"]) for r, v in sorted(out[0][1].items())] == [(1, True), (2, True), (3, True), (4, True)]
    want = _reference()
    for rank in (0, 1):
        assert torch.allclose(out[rank][0], want, rtol=1e-5, atol=1e-6), (rank, (out[rank][0] - want).abs().max())
    assert torch.equal(out[0][0], out[1][0])
    residual = out[0][1][4]["after"]["residual"]
    assert residual.abs().max() > 0, "int8 dropped nothing: error feedback is not exercised"


def test_a_failed_round_leaves_parameters_slow_buffers_and_residuals_as_they_were():
    out = _train(fail_round=2)  # the sync of fragment 1 after step 4
    for rank in (0, 1):
        rounds = out[rank][1]
        assert [rounds[r]["committed"] for r in sorted(rounds)] == [True, False, True, True]
        failed = rounds[2]
        for name, before in failed["before"].items():
            assert torch.equal(failed["after"][name], before), (rank, name)  # bit for bit
        names = ["params", "synced", "residual", "x0", "u"]
        moved = [n for n in names if not torch.equal(failed["worked"][n], failed["before"][n])]
        assert moved == names, moved  # the round's work had changed every one of them before it failed
    want = _reference(dropped=4)
    for rank in (0, 1):
        assert torch.allclose(out[rank][0], want, rtol=1e-5, atol=1e-6), rank


JOIN_STEPS = 24  # syncs every 2 steps; rank 2 starts once rank 0 is past step 4 and joins at a later sync


class _Paced(nn.Module):
    """`_model`, each training forward 40 ms long, so that the job is still training when rank 2 joins."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = _model(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.04)
        return self.net(x)


def _same(a: Any, b: Any) -> bool:
    """Entry by entry, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _joining_rank(store: Any, rank: int, past_step_4: threading.Event, out: dict) -> None:
    if rank == 2:
        past_step_4.wait(60)
    model = _Paced(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    manager = Manager(store, rank, 3, quorum_timeout=2.0, start_timeout=2.0, report=None)
    sync = FaultTolerantSync(manager, model, optimizer, _Recorder(), JOIN_STEPS, _schedule())  # type: ignore[arg-type]
    assert sync.pseudo is not None
    mine: dict[str, Any] = {"sent": {}, "rounds": {}}
    real_live, real_load, real_run = manager.live_state, manager.load_live_state, sync.pseudo.run

    def live_state() -> dict[str, Any]:  # what a healer sends (serialised at once: copied here)
        state = real_live()
        mine["sent"][manager.current().round] = copy.deepcopy(state)
        return state

    def load_live_state(state: Any) -> None:  # right after the heal: the joiner's registered state
        real_load(state)
        assert sync.pseudo is not None and sync.pseudo.outer.residual is not None
        mine["healed"] = (manager.quorum.round, copy.deepcopy(real_live()), sync.pseudo.outer.residual.clone())  # type: ignore[union-attr]

    def run(flat: torch.Tensor, step: int, lr: float) -> bool:
        committed = real_run(flat, step, lr)
        assert sync.pseudo is not None and sync.pseudo.outer.residual is not None
        mine["rounds"][manager.current().round] = (flat.clone(), sync.pseudo.outer.residual.clone(), committed, step)
        if rank == 0 and step >= 4:
            past_step_4.set()
        return committed

    manager.live_state, manager.load_live_state, sync.pseudo.run = live_state, load_live_state, run  # type: ignore[method-assign]
    loader = DataLoader(TensorDataset(*_data(rank, JOIN_STEPS)), batch_size=BATCH, shuffle=False)
    trainer = Trainer(model, optimizer, loader, callbacks=[sync])
    if rank == 2:
        assert manager.under_way()
        sync.rejoin(trainer)
    trainer.fit(epochs=1)
    sync.finish(trainer)
    out[rank] = mine
    manager.close()


def test_a_joiner_receives_the_averager_state_entry_by_entry_and_counts_zero_in_its_first_round():
    out = _in_threads(_joining_rank, 3, threading.Event())
    joined, received, residual = out[2]["healed"]
    sent = out[0]["sent"][joined]  # rank 0, the lowest member, heals
    assert {"model", "optimizer", "trainer", "slow", "outer_sync"} <= set(received)
    for name in sent:
        assert _same(received[name], sent[name]), name
    assert joined < max(out[0]["rounds"]), "rank 2 joined in the job's last round: no pseudo-gradient round to check"
    assert not residual.any(), "a joiner's residual starts at zero"
    flat0, residual0, committed, step = out[0]["rounds"][joined]
    assert committed and residual0.any()
    flat2, residual2, _, _ = out[2]["rounds"][joined]
    a, b = FRAGMENTS[0 if (step + 2) % 4 == 0 else 1]  # the fragment this round synced
    assert torch.equal(flat2, flat0)  # the synced fragment's mean, and the healer's own other fragment
    assert torch.equal(out[1]["rounds"][joined][0][a:b], flat0[a:b])
    assert not residual2.any(), "the joiner counted zero: nothing of its own was sent, nothing dropped"
    later = min(r for r in out[2]["rounds"] if r > joined)
    assert out[2]["rounds"][later][1].any(), "from its next round on the joiner counts (and keeps a residual)"
