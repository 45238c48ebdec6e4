"""One accelerate training loop, run by accelerate's own DDP and by ddpkit's recipe, in one torchrun job (used by
tests/test_accelerate.py): ``torchrun --nproc-per-node N tests/accelerate_runs.py OUT``.

The loop: Adam, a step-wise scheduler, gradient accumulation over 2 micro-batches, clipping by norm 0.05; 4
optimizer steps, ``save_state``, 4 more; then a fresh model and optimizer ``load_state`` the checkpoint and run the
last 4 again. Every rank writes ``OUT/MODE.rank{r}.json`` (MODE ``ddp`` or ``sharded``): the losses, the final
parameters, the parameters after the resumed run, and the bytes of optimizer state it holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.integrations.accelerate import clip_grad_norm_, prepare_sharded


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


def _train(accelerator: Accelerator, mode: str, parts: tuple, batches: list, steps: int) -> list[float]:
    model, optimizer, _, scheduler = parts
    losses: list[float] = []
    done = 0
    while done < steps:
        x, y = batches.pop(0)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if mode == "sharded":
                    clip_grad_norm_(accelerator, optimizer, 0.05)
                else:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
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
    rest = list(batches)
    losses += _train(accelerator, mode, parts, batches, 4)
    final = _params(parts[0])
    inner = getattr(parts[1].optimizer, "optim", parts[1].optimizer)
    held = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    accelerator.free_memory()

    resumed = Accelerator(cpu=True, gradient_accumulation_steps=2)
    again = _setup(resumed, mode)
    resumed.load_state(str(out / f"{mode}-ckpt"))
    resumed_losses = _train(resumed, mode, again, rest, 4)
    record = {"losses": losses, "params": final, "resumed_losses": resumed_losses, "resumed": _params(again[0]),
              "state_bytes": held, "model": type(parts[0]).__name__}  # fmt: skip
    (out / f"{mode}.rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for mode in ("ddp", "sharded"):
        run(mode, Path(sys.argv[1]))
