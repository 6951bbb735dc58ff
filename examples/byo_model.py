"""Bring your own model: an ordinary LightningModule that hybrid3d can pipeline and tensor-parallelize.

A residual-MLP classifier on a generated, learnable dataset. Beyond plain Lightning it has three small
methods (marked "protocol" below): its layers in forward order, a tensor-parallel plan, and its loss as a
method that the steps call as ``self.loss(self(x), y)``. Nothing else changes, so it also trains
unchanged under Lightning's own strategies:

    python examples/byo_model.py --strategy auto --devices 1
    python examples/byo_model.py --strategy ddp --devices 2
    python examples/byo_model.py --strategy hybrid3d --pp 2 --tp 2 --devices 4
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset


class ResidualMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPClassifier(pl.LightningModule):
    """features (B, in_features) -> class logits (B, classes)."""

    def __init__(
        self, in_features: int = 32, width: int = 64, hidden: int = 128, depth: int = 6, classes: int = 8, lr=1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualMLP(width, hidden) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    # ----- protocol: what hybrid3d reads, all optional under other strategies -----

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers forward runs, in order; each takes the previous one's output (pp > 1)."""
        return [self.stem, *self.blocks, self.head]

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """The loss of one batch from forward's output (pp > 1 computes it on the last stage)."""
        return F.cross_entropy(logits, target)

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Megatron's MLP split on the tp axis: fc1 by output columns, fc2 by input rows (tp > 1)."""
        if sequence_parallel:
            raise ValueError("MLPClassifier has no sequence dimension: set sequence_parallel=False.")
        return {"blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel()}

    # ----- plain Lightning -----

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def teacher_dataset(num_samples: int, in_features: int = 32, classes: int = 8, seed: int = 0) -> TensorDataset:
    """Gaussian features (drawn with ``seed``) labelled by one fixed random two-layer network: learnable,
    made on any machine; different seeds give train and validation splits of the same task."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(in_features, 64, generator=teacher) / in_features**0.5
    w2 = torch.randn(64, classes, generator=teacher) / 8
    x = torch.randn(num_samples, in_features, generator=torch.Generator().manual_seed(seed))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=-1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto", help="auto, ddp, hybrid3d or a zero* name")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    import lightning_parallel  # noqa: F401  (registers hybrid3d and the zero strategies)
    from lightning_parallel import Hybrid3DStrategy

    pl.seed_everything(0)
    strategy = Hybrid3DStrategy(pp=args.pp, tp=args.tp) if args.strategy == "hybrid3d" else args.strategy
    train, val = teacher_dataset(8192, seed=0), teacher_dataset(1024, seed=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        val_check_interval=100,
        check_val_every_n_epoch=None,  # every 100 steps whatever the epoch length (64 batches at --devices 2)
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        MLPClassifier(),
        DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(val, batch_size=64),
    )


if __name__ == "__main__":
    main()
