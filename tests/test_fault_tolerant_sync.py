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
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.fault_tolerance.manager import Manager
from ddpkit.train.loop.fault_tolerant_sync import FaultTolerantSync, OuterSchedule
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


def _rank(store: Any, rank: int, outer: OuterSchedule | None, fail_round: int, out: dict, overlap: bool,
          scaled: bool = False) -> None:  # fmt: skip
    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    manager = Manager(store, rank, 2, quorum_timeout=1.0, start_timeout=20, report=None)
    if rank == 1:  # this rank fails in `fail_round` after its average (both ranks hold the average then)
        for name in ("average", "average_gradients"):
            _fail_after(manager, name, fail_round)
    scaler = _scaler() if scaled else None
    sync = FaultTolerantSync(manager, model, optimizer, _Recorder(), STEPS, outer, overlap=overlap, scaler=scaler)  # type: ignore[arg-type]
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


def _train(outer: OuterSchedule | None, fail_round: int, overlap: bool = True, scaled: bool = False) -> dict:
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_rank, args=(store, r, outer, fail_round, out, overlap, scaled), daemon=True)
               for r in (0, 1)]  # fmt: skip
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


def test_local_sgd_rounds_equal_the_definition_and_a_failed_sync_averages_nothing():
    outer = OuterSchedule(every=2, slow_every=4, rule=None)  # a sync every 2 steps (rounds 1..4), no slow momentum
    out = _train(outer, fail_round=2)  # the sync after step 4 is dropped: both keep their local parameters
    assert out[0][1] == out[1][1] == [(2, False)]
    models = [_model(0), _model(0)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    for step in range(STEPS):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(_batch(rank, step)[0]), _batch(rank, step)[1]).backward()
            optimizer.step()
        if (step + 1) % 2 == 0 and step + 1 != 4:
            with torch.no_grad():
                for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
    for rank in (0, 1):
        assert _close(out[rank][0], [p.detach() for p in models[rank].parameters()]), rank


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
