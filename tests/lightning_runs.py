"""Trains one small LightningModule under several strategies and settings, in one torchrun job (used by
tests/test_lightning.py): ``torchrun --nproc-per-node N tests/lightning_runs.py OUT RUN[,RUN...]``.

A run is ``STRATEGY:SETTING`` (setting names in SETTINGS), or ``fabric/STRATEGY:SETTING`` for the same training
written as a Fabric loop (automatic-optimization settings only; its file is named ``fabric-STRATEGY:...``). Every
rank writes ``OUT/STRATEGY:SETTING.rank{r}.json``: its per-step losses, its final parameters (flattened), the bytes
of optimizer state it holds, the bytes ddpkit sent during `fit`, the learning rates it stepped with, and what
`validate`, `test` and `predict` gave after `fit`. The data, the model and its initial weights are the same for
every run (seeded).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.distributed import comm_stats
from ddpkit.integrations.lightning import (  # (the import registers the ddpkit_* strategies)
    DDPKitFabricShardedStrategy,
    DDPKitShardedStrategy,
    DDPKitSlowMoStrategy,
)

SETTINGS: dict[str, dict] = {
    "adam": {"optimizer": "adam"},
    "sgd": {"optimizer": "sgd"},
    "adam-clip-accum-sched": {"optimizer": "adam", "clip": 0.05, "accumulate": 2, "scheduler": True},
    "sgd-clip-sched": {"optimizer": "sgd", "clip": 0.5, "scheduler": True},
    "two-optimizers": {"optimizer": "two", "manual": True},  # Lightning 2 steps several optimizers manually only
    "manual": {"optimizer": "adam", "manual": True},
    "adam-bf16": {"optimizer": "adam", "precision": "bf16-mixed"},
    "sgd-plain": {"optimizer": "sgd-plain"},  # no momentum: local SGD averaging every step is then DDP
    # fp16 on the CPU (Lightning would turn precision="16-mixed" into bf16 there) from a scale so large that the
    # first steps overflow and are skipped, on every rank alike
    "sgd-fp16-skips-clip": {"optimizer": "sgd", "precision": "fp16", "clip": 0.5},
    # checkpoints: two epochs at once; one epoch saved to OUT/STRATEGY.ckpt; the second epoch resumed from the
    # checkpoint named by $LIGHTNING_RESUME (default OUT/ddpkit_sharded.ckpt, however many processes wrote it)
    "adam-2epochs": {"optimizer": "adam", "epochs": 2},
    "adam-save-after-1": {"optimizer": "adam", "epochs": 1, "save": True},
    "adam-resume": {"optimizer": "adam", "epochs": 2, "resume": "ddpkit_sharded"},
    # SlowMo's state in the checkpoint: plain SGD (no optimizer state), an epoch (16 steps) ending on a sync
    "sgd-plain-2epochs": {"optimizer": "sgd-plain", "epochs": 2},
    "sgd-plain-save-after-1": {"optimizer": "sgd-plain", "epochs": 1, "save": True},
    "sgd-plain-resume": {"optimizer": "sgd-plain", "epochs": 2, "resume": "ddpkit_slowmo-momentum"},
}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()
    return TensorDataset(x, y)


class Net(L.LightningModule):
    """A two-layer MLP; `setting` chooses optimizers, scheduler and manual optimization."""

    def __init__(self, setting: dict) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))
        self.setting = setting
        self.automatic_optimization = not setting.get("manual", False)
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor | None:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return None

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        self.log("test_accuracy", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)

    def on_train_batch_end(self, *args: object) -> None:
        optimizers = self.optimizers()
        first = optimizers[0] if isinstance(optimizers, list) else optimizers
        self.lrs.append(float(first.param_groups[0]["lr"]))

    def configure_optimizers(self):
        kind = self.setting["optimizer"]
        if kind == "two":  # one optimizer per layer, stepped together (Lightning calls both each step)
            first = torch.optim.Adam(self.body[0].parameters(), lr=0.01)
            second = torch.optim.SGD(self.body[2].parameters(), lr=0.1, momentum=0.9)
            return [first, second]
        params = self.parameters()
        if kind == "adam":
            optimizer = torch.optim.Adam(params, lr=0.01)
        else:
            optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.0 if kind == "sgd-plain" else 0.9)
        if not self.setting.get("scheduler"):
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of per-element state (Adam's moments, SGD's momentum; not the 0-d step counters, one per tensor,
    of which a parameter cut over the ranks has one per piece)."""
    inner = getattr(optimizer, "optim", optimizer)  # an OSS keeps its shard's state in its own optimizer
    tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


STRATEGIES = {  # names that stand for a configured instance
    "ddpkit_slowmo-every-step": lambda: DDPKitSlowMoStrategy(
        slowmo_kwargs={"nprocs_per_node": 1, "localsgd_frequency": 1, "slowmo_frequency": 1, "slowmo_momentum": 0.0}
    ),
    "ddpkit_slowmo-momentum": lambda: DDPKitSlowMoStrategy(
        slowmo_kwargs={"nprocs_per_node": 1, "localsgd_frequency": 4, "slowmo_frequency": 4, "slowmo_momentum": 0.5}
    ),
    # every tensor may be cut over the ranks, so this small model's optimizer state is about 1/N per rank too
    "ddpkit_sharded-split": lambda: DDPKitShardedStrategy(oss_kwargs={"min_split_numel": 1}),
    "fabric/ddpkit_sharded-split": lambda: DDPKitFabricShardedStrategy(oss_kwargs={"min_split_numel": 1}),
}


def _scale(trainer: L.Trainer) -> float | None:
    """The loss scale the run ended with (None without a scaler)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else None


def run(name: str, devices: int, out: Path) -> None:
    strategy_name, setting_name = name.split(":")
    strategy = STRATEGIES[strategy_name]() if strategy_name in STRATEGIES else strategy_name
    setting = SETTINGS[setting_name]
    model = Net(setting)
    precision = {"precision": setting.get("precision", "32-true")}
    if setting.get("precision") == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    trainer = L.Trainer(
        **precision,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=-1 if "epochs" in setting else 12,
        max_epochs=setting.get("epochs"),
        gradient_clip_val=setting.get("clip"),
        accumulate_grad_batches=setting.get("accumulate", 1),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(_data(), batch_size=16, shuffle=False)
    resume = None
    if setting.get("resume"):
        default = str(out / f"{setting['resume']}.ckpt")
        resume = os.environ.get("LIGHTNING_RESUME", default) if setting_name == "adam-resume" else default
    with comm_stats.measure() as sent:  # what ddpkit sent (torch DDP's own all-reduces are not counted)
        trainer.fit(model, loader, ckpt_path=resume)
    if setting.get("save"):
        trainer.save_checkpoint(out / f"{strategy_name}.ckpt")  # on every rank: a sharded state is gathered
    optimizers = trainer.optimizers
    state = sum(_state_bytes(o) for o in optimizers)
    validated = trainer.validate(model, loader, verbose=False)  # after fit: the module is unwrapped and evaluates
    tested = trainer.test(model, loader, verbose=False)
    predictions = trainer.predict(model, DataLoader(_data(), batch_size=64), return_predictions=True)
    rank = trainer.global_rank
    record = {
        "losses": model.losses,
        "lrs": model.lrs,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
        "state_bytes": state,
        "sent_bytes": sent.sent_bytes(),
        "payload_bytes": sent.payload_bytes(),  # shared memory on one host included
        "optimizers": [type(o).__name__ for o in optimizers],
        "val_loss": float(validated[0]["val_loss"]),
        "test_accuracy": float(tested[0]["test_accuracy"]),
        "predicted": int(sum(len(p) for p in predictions)),
        "scale": _scale(trainer),
    }
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


def run_fabric(name: str, devices: int, out: Path) -> None:
    """The automatic optimization of `run`, as a Fabric loop: backward, clipping by norm, accumulation with
    no_backward_sync on all but the last micro-batch, the scheduler stepped per optimizer step."""
    strategy_name, setting_name = name.removeprefix("fabric/").split(":")
    setting = SETTINGS[setting_name]
    plugins = None
    if setting.get("precision") == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
        plugins = [FabricMixedPrecision("16-mixed", "cpu", scaler=scaler)]
    precision = setting.get("precision", "32-true") if plugins is None else None
    key = f"fabric/{strategy_name}"
    strategy = STRATEGIES[key]() if key in STRATEGIES else strategy_name
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins, precision=precision)
    fabric.launch()  # under torchrun: joins the job's process group
    module = Net(setting)
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=16, shuffle=False))
    accumulate, steps = setting.get("accumulate", 1), 0
    batches = (batch for _ in range(100) for batch in loader)  # epochs after epochs (the same order each)
    with comm_stats.measure() as sent:
        while steps < 12:
            for micro in range(accumulate):
                x, y = next(batches)
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    loss = F.cross_entropy(model(x), y)
                    module.losses.append(float(loss.detach()))
                    fabric.backward(loss / accumulate)
            if setting.get("clip"):
                fabric.clip_gradients(model, optimizer, max_norm=setting["clip"], error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            module.lrs.append(float(optimizer.param_groups[0]["lr"]))
            if scheduler is not None:
                scheduler.step()
            steps += 1
    record = {
        "losses": module.losses,
        "lrs": module.lrs,
        "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist(),
        "state_bytes": _state_bytes(optimizer.optimizer),
        "payload_bytes": sent.payload_bytes(),
        "optimizers": [type(optimizer.optimizer).__name__],
        "scale": float(scaler.get_scale()) if (scaler := getattr(fabric.strategy.precision, "scaler", None)) else None,
    }
    (out / f"{name.replace('/', '-')}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    devices = int(os.environ["WORLD_SIZE"])
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    for name in names:
        (run_fabric if name.startswith("fabric/") else run)(name, devices, out)


if __name__ == "__main__":
    main()
