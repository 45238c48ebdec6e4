"""One accelerate training loop, run by accelerate's own DDP and by ddpkit's recipe, in one torchrun job (used by
tests/test_accelerate.py): ``accelerate launch --multi_gpu --num_processes N tests/accelerate_runs.py OUT`` (on
the CPU too; torchrun works as well).

The loop: Adam, a step-wise scheduler, gradient accumulation over 2 micro-batches, clipping by norm 0.05; 4
optimizer steps, ``save_state``, 4 more; then a fresh model and optimizer ``load_state`` the checkpoint and run the
last 4 again. Every rank writes ``OUT/MODE.rank{r}.json`` (MODE ``ddp`` or ``sharded``): the losses, the final
parameters, the parameters after the resumed run, and the bytes of optimizer state it holds; and
``OUT/MODE-scaled.rank{r}.json`` for the same loop under a loss scaler that overflows (`run_scaled`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.integrations.accelerate import prepare_sharded
from ddpkit.optim import OSS


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long())


def _setup(accelerator: Accelerator, mode: str) -> tuple:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(_data(), batch_size=16, shuffle=False)
    if mode == "sharded":
        model, optimizer = prepare_sharded(accelerator, model, optimizer)
        loader, scheduler = accelerator.prepare(loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return model, optimizer, loader, scheduler


def _train(
    accelerator: Accelerator,
    mode: str,
    parts: tuple,
    batches: list,
    steps: int,
    clip: float | None = 0.05,
    spike: torch.Tensor | None = None,
) -> list[float]:
    """`steps` optimizer steps; `spike`: a parameter whose gradient gets 2**100 more on this rank (the loss's
    value unchanged), so that a large loss scale overflows that one gradient only."""
    model, optimizer, _, scheduler = parts
    losses: list[float] = []
    done = 0
    while done < steps:
        x, y = batches.pop(0)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            if spike is not None:
                loss = loss + 2.0**100 * (spike - spike.detach()).sum()
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip is not None:  # the same call in both modes: under prepare_sharded
                accelerator.clip_grad_norm_(model.parameters(), clip)  # it clips by the norm over every shard
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        done += int(accelerator.sync_gradients)
    return losses


def _params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def run(mode: str, out: Path) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    parts = _setup(accelerator, mode)
    batches = list(parts[2])
    losses = _train(accelerator, mode, parts, batches, 4)
    accelerator.save_state(str(out / f"{mode}-ckpt"))
    saved = _params(parts[0])
    # save_state must not leave the whole optimizer state on every rank (only the writer consolidates)
    whole_state_here = getattr(parts[1].optimizer, "_consolidated", None) is not None
    rest = list(batches)
    losses += _train(accelerator, mode, parts, batches, 4)
    final = _params(parts[0])
    inner = getattr(parts[1].optimizer, "optim", parts[1].optimizer)
    held = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    # load_state into the model that has trained since (its parameters live in OSS's buffers)
    accelerator.load_state(str(out / f"{mode}-ckpt"))
    reloaded = _params(parts[0])
    reloaded_losses = _train(accelerator, mode, parts, list(rest), 4)
    accelerator.free_memory()

    resumed = Accelerator(cpu=True, gradient_accumulation_steps=2)
    again = _setup(resumed, mode)
    resumed.load_state(str(out / f"{mode}-ckpt"))
    resumed_losses = _train(resumed, mode, again, rest, 4)
    record = {
        "losses": losses,
        "params": final,
        "resumed_losses": resumed_losses,
        "resumed": _params(again[0]),
        "state_bytes": held,
        "model": type(parts[0]).__name__,
        "saved": saved,
        "reloaded": reloaded,
        "reloaded_losses": reloaded_losses,
        "whole_state_here": whole_state_here,
    }
    (out / f"{mode}.rank{accelerator.process_index}.json").write_text(json.dumps(record))


def run_scaled(mode: str, out: Path) -> None:
    """The loop (without clipping) under the loss scaler accelerate makes for ``mixed_precision="fp16"`` on a GPU (on
    the CPU it makes none), set by hand before `prepare`. On rank 0 one parameter that rank 0 owns in the sharded
    run gets a gradient 2**100 larger, which overflows fp32 at scales of 2**28 and above (the two micro-batches'
    gradients, 2**127 each at 2**28, add up to 2**128): the sharded run then finds the inf on rank 0 only (rank 1
    neither owns that gradient nor computed an inf), so the ranks skip alike only through the ShardedGradScaler
    that `prepare_sharded` puts in place of torch's. Starting at 2**36 with a backoff of 1/16, three steps are
    skipped (2**36, 2**32, 2**28), as under accelerate's DDP."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**36, backoff_factor=2.0**-4, growth_interval=1000)
    parts = _setup(accelerator, mode)
    module = parts[0].module
    probe = OSS(module.parameters(), optim=torch.optim.Adam, lr=0.01)  # the sharded run's owners (same rule)
    owned = [p for p in module.parameters() if probe.owner_of(p) == 0]
    spike = owned[-1] if accelerator.process_index == 0 else None
    losses = _train(accelerator, mode, parts, list(parts[2]), 6, clip=None, spike=spike)
    record = {
        "losses": losses,
        "params": _params(parts[0]),
        "scale": float(accelerator.scaler.get_scale()),
        "scaler": type(accelerator.scaler).__name__,
        "spiked_numel": owned[-1].numel(),
    }
    (out / f"{mode}-scaled.rank{accelerator.process_index}.json").write_text(json.dumps(record))


DOCUMENTED = "model, optimizer = prepare_sharded(accelerator, model, optimizer)   # instead of accelerator.prepare"


def run_documented(out: Path) -> None:
    """The accelerate loop of docs/integrations.md as written, with the reader's names supplied: every rank ends
    on the same parameters, moved from where they started, and the checkpoint is written."""
    from test_readme import snippet  # (this script's folder is on the path)

    code = snippet(DOCUMENTED)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))
    start = _params(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3)
    loader = DataLoader(_data(), batch_size=16)
    namespace = {
        "model": model,
        "optimizer": optimizer,
        "loss_fn": F.cross_entropy,
        "loader": loader,
        "scheduler": scheduler,
    }
    previous = os.getcwd()
    os.chdir(out)
    try:
        exec(compile(code, str(code.path), "exec"), namespace)
    finally:
        os.chdir(previous)
    namespace["accelerator"].wait_for_everyone()  # rank 0 writes the checkpoint; the others may be ahead
    rank = namespace["accelerator"].process_index
    record = {"start": start, "params": _params(model), "checkpoint": (out / "ckpt" / "optimizer.bin").exists()}
    (out / f"documented.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for mode in ("ddp", "sharded"):
        run(mode, Path(sys.argv[1]))
        run_scaled(mode, Path(sys.argv[1]))
    run_documented(Path(sys.argv[1]))
