"""Lightning with ddpkit's sharded strategy: what ``Trainer(strategy="ddp_sharded")`` was with fairscale.

    pip install -e ".[lightning]"
    python examples/lightning_digits.py                          # 2 CPU processes, ddpkit_sharded
    python examples/lightning_digits.py --strategy ddp           # Lightning's own DDP, for comparison
    python examples/lightning_digits.py --strategy ddpkit_oss --devices 4 --clip 1.0 --accumulate 2
    python examples/lightning_digits.py --min-split-numel 1      # cut tensors too: the state 1/N per rank

Trains an MLP on scikit-learn's digits (shipped with scikit-learn: nothing is downloaded) for a few epochs and
prints, on rank 0, the held-out accuracy and each rank's optimizer state in bytes: with a ddpkit strategy the
ranks split the state that every rank of ``ddp`` holds whole. The importing of `ddpkit.integrations.lightning`
is what makes the ``ddpkit_*`` names known to Lightning.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader

# the import registers ddpkit_sharded, ddpkit_oss and ddpkit_slowmo with Lightning
from ddpkit.distributed.launch import leave
from ddpkit.integrations.lightning import DDPKitOSSStrategy, DDPKitShardedStrategy
from ddpkit.train.workloads.data import digits
from ddpkit.train.workloads.models import mlp


class DigitsClassifier(L.LightningModule):
    """An MLP on 8x8 digits with Adam and a step-wise learning-rate decay."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = mlp(64, 10, hidden=256, depth=2)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        accuracy = (self.model(x).argmax(1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of optimizer state this rank holds (an OSS holds its shard in its inner optimizer)."""
    inner = getattr(optimizer, "optim", optimizer)
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))


def main() -> None:
    train(parse_args())  # the trainer, its strategy and the model are gone when it returns
    leave()  # then the process group: left alive, gloo can abort the process at interpreter exit


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddpkit_sharded", help="ddpkit_sharded, ddpkit_oss, ddpkit_slowmo, ddp")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (by the norm over all shards)")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument(
        "--min-split-numel",
        type=int,
        default=None,
        help="ddpkit_sharded/ddpkit_oss: OSS(min_split_numel=N), tensors of N elements or more may be cut over the "
        "ranks (default: 2**20, which no tensor of this small model reaches, so each goes whole to one rank); "
        "with ddpkit_sharded a cut tensor keeps a full-size gradient on every rank",
    )
    args = parser.parse_args()
    if args.min_split_numel is not None and args.strategy not in ("ddpkit_sharded", "ddpkit_oss"):
        parser.error(f"--min-split-numel needs --strategy ddpkit_sharded or ddpkit_oss, not {args.strategy}")
    return args


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    data = digits()
    strategy: str | Strategy = args.strategy
    if args.min_split_numel is not None:
        classes = {"ddpkit_sharded": DDPKitShardedStrategy, "ddpkit_oss": DDPKitOSSStrategy}
        strategy = classes[args.strategy](oss_kwargs={"min_split_numel": args.min_split_numel})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = DigitsClassifier(args.lr)
    trainer.fit(model, DataLoader(data.train, batch_size=32, shuffle=True), DataLoader(data.test, batch_size=256))
    held = trainer.strategy.all_gather(torch.tensor(sum(optimizer_state_bytes(o) for o in trainer.optimizers)))
    accuracy = float(trainer.callback_metrics["val_accuracy"])
    if trainer.is_global_zero:
        print(f"strategy {args.strategy} on {args.devices} processes: held-out accuracy {accuracy:.3f}")
        print(f"optimizer state per rank (bytes): {held.tolist()}")


if __name__ == "__main__":
    main()
