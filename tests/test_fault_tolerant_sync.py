"""`ddpkit train --fault-tolerant`'s rounds (`FaultTolerantSync`, a client of the `Manager`), in one process.

Each rank is a thread running the `Trainer` with the callback the command runs, meeting the others in a HashStore.
The reference is written apart from the code under test: one model stepped by torch's SGD (with momentum) on the
mean gradient of each committed round's members (DDP), or local SGD's definition (every member takes its local
steps, a committed sync replaces the parameters by their mean). A round that fails on one rank must leave every
member where it was: applying the un-averaged gradient there (or keeping the un-averaged parameters) fails here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.algorithms.slow_momentum import SlowMoRule
from ddpkit.fault_tolerance.manager import Manager
from ddpkit.train.loop.fault_tolerant_sync import FaultTolerantSync, GossipSchedule, OuterSchedule
from ddpkit.train.loop.trainer import Trainer

LR, MOMENTUM, STEPS, BATCH = 0.1, 0.9, 8, 6
SEEDING = threading.Lock()


def _model(seed: int) -> nn.Module:
    with SEEDING:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


POISONED = (1, 2)  # with a loss scaler: rank 1's batch of step 2 holds a NaN (its gradients overflow)


def _data(rank: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    x, y = torch.randn(STEPS * BATCH, 4, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g)
    if poison and rank == POISONED[0]:
        x[POISONED[1] * BATCH] = float("nan")
    return x, y


def _batch(rank: int, step: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(rank, poison)
    return x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]


class _Recorder:
    def annotate_last(self, **columns: Any) -> None:
        pass


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # grows every 2 good steps


def _rank(
    store: Any,
    rank: int,
    outer: OuterSchedule | None,
    fail_round: int,
    out: dict,
    overlap: bool,
    scaled: bool = False,
    gossip: GossipSchedule | None = None,
) -> None:
    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    manager = Manager(store, rank, 2, quorum_timeout=1.0, start_timeout=20, report=None)
    if rank == 1:  # this rank fails in `fail_round` after its average (both ranks hold the average then)
        for name in ("collective", "average_gradients"):
            _fail_after(manager, name, fail_round)
    scaler = _scaler() if scaled else None
    sync = FaultTolerantSync(
        manager,
        model,
        optimizer,
        _Recorder(),
        STEPS,
        outer,
        gossip,
        overlap=overlap,  # type: ignore[arg-type]
        scaler=scaler,
    )
    loader = DataLoader(TensorDataset(*_data(rank, scaled)), batch_size=BATCH, shuffle=False)
    trainer = Trainer(model, optimizer, loader, scaler=scaler, callbacks=[sync])
    trainer.fit(epochs=1)
    sync.finish(trainer)
    out[rank] = ([p.detach().clone() for p in model.parameters()], [(e.round, e.committed) for e in manager.events])
    if scaler is not None:
        out[rank] += (scaler.get_scale(),)


def _fail_after(manager: Manager, name: str, fail_round: int) -> None:
    real = getattr(manager, name)

    def failing(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        if manager.current().round == fail_round:
            manager.fail()

    setattr(manager, name, failing)


def _train(
    outer: OuterSchedule | None,
    fail_round: int,
    overlap: bool = True,
    scaled: bool = False,
    gossip: GossipSchedule | None = None,
) -> dict:
    store, out = dist.HashStore(), {}
    threads = [
        threading.Thread(target=_rank, args=(store, r, outer, fail_round, out, overlap, scaled, gossip), daemon=True)
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == [0, 1], "a rank failed or hung"
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def _ddp_reference(dropped_step: int, scaler: torch.amp.GradScaler | None = None) -> list[torch.Tensor]:
    """DDP's definition: one model (rank 0's), torch's SGD (and loss scaler) on the mean of both ranks' (scaled)
    gradients at every step but the dropped one."""
    model = _model(0)  # the first round gives every rank rank 0's model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        if step + 1 == dropped_step:
            continue
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            x, y = _batch(rank, step, poison=scaler is not None)
            loss = nn.functional.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = (grads[0][i] + grads[1][i]) / 2
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("overlap", [True, False], ids=["buckets-during-backward", "flat-after-backward"])
def test_ddp_rounds_equal_torch_sgd_on_the_mean_gradient_and_a_failed_round_steps_nowhere(overlap):
    out = _train(None, fail_round=4, overlap=overlap)  # round s is step s: step 4's gradients dropped on both
    assert out[0][1] == out[1][1] == [(4, False)]
    want = _ddp_reference(4)
    assert _close(out[0][0], want) and _close(out[1][0], want)


def test_ddp_rounds_with_a_loss_scaler_skip_an_overflow_everywhere_and_equal_torchs_scaler():
    """fp16's loss scaler under fault tolerance: rank 1's gradients of step 2 overflow (a NaN in its batch); the
    averaged gradients overflow on both members, so both skip that step and halve the scale, as torch's GradScaler
    does on the mean gradient; the failed round 4 steps nowhere and leaves the scale alone. Reference: one model,
    torch's SGD and GradScaler on the mean of both ranks' scaled gradients."""
    out = _train(None, fail_round=4, scaled=True)
    assert out[0][1] == out[1][1] == [(4, False)]
    scaler = _scaler()
    want = _ddp_reference(4, scaler)
    assert scaler.get_scale() != 2.0**10  # it moved (halved once, grown since)
    assert out[0][2] == out[1][2] == scaler.get_scale()
    assert _close(out[0][0], want) and _close(out[1][0], want)


def _synced_reference(synced: Callable[[int], bool], beta: float, alpha: float) -> list[list[torch.Tensor]]:
    """Each rank's parameters by the definition: two models (rank 0's at the start), each torch SGD with momentum on
    its own batches; after each step s (1-based) where `synced(s)`, both take their mean, and on every 4th step
    SlowMo's rule moves it: u = beta u + (x0 - mean) / lr; x0 -= alpha lr u; x = x0."""
    models = [_model(0), _model(0)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    x0 = [p.detach().clone() for p in models[0].parameters()]
    u = [torch.zeros_like(p) for p in x0]
    for step in range(1, STEPS + 1):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            x, y = _batch(rank, step - 1)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        if not synced(step):
            continue
        with torch.no_grad():
            for i, (a, b) in enumerate(zip(models[0].parameters(), models[1].parameters(), strict=True)):
                mean = (a + b) / 2
                if step % 4 == 0:
                    u[i] = beta * u[i] + (x0[i] - mean) / LR
                    x0[i] = x0[i] - alpha * LR * u[i]
                    mean = x0[i].clone()
                a.copy_(mean)
                b.copy_(mean)
    return [[p.detach() for p in model.parameters()] for model in models]


def test_local_sgd_rounds_with_slow_momentum_equal_the_definition_and_a_failed_sync_changes_nothing():
    """A sync every 2 steps (rounds 1..4), slow momentum every 4; the sync after step 4 (round 2, a slow step) fails
    on rank 1 after its average: both keep their local parameters and the slow buffers stay as they were, so the
    slow step after step 8 starts from the untouched x0 and u."""
    out = _train(OuterSchedule(every=2, slow_every=4, rule=SlowMoRule(0.5, 2.0)), fail_round=2)
    assert out[0][1] == out[1][1] == [(2, False)]
    want = _synced_reference(lambda step: step % 2 == 0 and step != 4, 0.5, 2.0)
    for rank in (0, 1):
        assert _close(out[rank][0], want[rank]), rank


def test_a_failed_last_average_is_tried_again_so_every_replica_ends_alike():
    """Local SGD syncs every 3 steps, so steps 7 and 8 are local and the job's last round (an exact average of the
    models) is what makes the replicas equal; it fails on rank 1: the members average again in the next round and
    both end with the same model (a failed last round was the end: each kept its own)."""
    outer = OuterSchedule(every=3, slow_every=6, rule=SlowMoRule(0.5, 2.0))
    last = STEPS // 3 + 1
    out = _train(outer, fail_round=last)
    assert (last, False) in out[0][1], out[0][1]
    assert _close(out[0][0], out[1][0])


def test_sgp_rounds_with_slow_momentum_equal_the_definition_and_a_failed_round_changes_nothing():
    """SGP's push-sum among 2 members: each keeps half of [x, w] and sends half to the other, so every committed
    round (gossip or exact) leaves both on the mean of their models, with w = 1; every 4th step's round is exact
    and slow momentum moves the mean; round 3 fails on rank 1 after its exchange, so both keep their own models
    there."""
    gossip = GossipSchedule("npeer-exponential", 1, slow_every=4, rule=SlowMoRule(0.5, 2.0))
    out = _train(None, fail_round=3, gossip=gossip)
    assert out[0][1] == out[1][1] == [(3, False)]
    want = _synced_reference(lambda step: step != 3, 0.5, 2.0)
    assert _close(out[0][0], want[0]) and _close(out[1][0], want[0])


def test_a_checkpoint_is_written_beside_training_and_a_failed_write_is_raised(tmp_path, monkeypatch):
    """A slow disk must not hold up the next round: `save` returns once the state is serialised; `wait` ends the
    write (its folder committed, the state intact); a write that fails is raised by the next `wait`."""
    from ddpkit.train.checkpoints import checkpoint_files, live_checkpoint

    real = checkpoint_files.write_atomic

    def slow(path: str, data: bytes) -> None:
        time.sleep(1.0)
        real(path, data)

    monkeypatch.setattr(checkpoint_files, "write_atomic", slow)
    plan = live_checkpoint.LiveCheckpoints(str(tmp_path), 10, 2, {"world_size": 2, "strategy": "ddp"})
    state = {"model": {"w": torch.arange(4.0)}}
    began = time.monotonic()
    plan.save(state, 10, 0, 0, 10)
    state["model"]["w"].add_(100)  # training goes on: the checkpoint holds the state as it was saved
    assert time.monotonic() - began < 0.5
    folder = plan.wait()
    assert folder is not None and (tmp_path / "checkpoint" / "step-00000010").is_dir()
    saved = torch.load(tmp_path / "checkpoint" / "step-00000010" / "live.pt")
    assert torch.equal(saved["model"]["w"], torch.arange(4.0))

    def full(path: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "write_atomic", full)
    plan.save(state, 20, 0, 0, 20)
    with pytest.raises(OSError, match="No space left"):
        plan.wait()
