"""VGG image classification as an ordinary LightningModule, plus the protocol methods hybrid3d reads (its
ordered layers, a channel-split TP plan, a degree check, the loss); it runs unchanged under "auto", "ddp"
and the zero strategies."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.models.vgg import VGG, VGGConfig, vgg_tp_plan
from lightning_parallel.parallel.mesh import ParallelDims

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")
EXAMPLE_MICROBATCH = 4  # images in example_input_array


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The learning rate at optimizer step ``step`` as a fraction of the peak: a linear warmup over
    ``warmup_steps``, then constant or a cosine decay that reaches 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LitVGG(pl.LightningModule):
    """Cross-entropy classification with SGD (momentum, Nesterov off) or AdamW; weight decay on conv and
    Linear weights only (two param groups).

    BatchNorm in training mode normalizes with the statistics of the batch it sees: under data parallelism
    that is each rank's slice, under pipelining each microbatch. To make them those of the whole
    data-parallel batch again, ask the Trainer, not this module: ``Trainer(sync_batchnorm=True)`` under
    ``hybrid3d`` and ``zero*``, or ``Trainer(plugins=[DataParallelSyncBatchNorm()])`` under any strategy
    (Lightning's ``ddp`` included, on CPU too; ``sync_batchnorm=True`` there means torch's SyncBatchNorm,
    which trains only on GPUs). The strategy swaps the BatchNorms before it splits the model.

    Args:
        config: the model's shape.
        optimizer: ``"sgd"`` (with ``momentum``) or ``"adamw"``.
        lr: learning rate.
        momentum: SGD momentum; AdamW keeps its default betas instead.
        weight_decay: applied to weights of dimension >= 2.
        warmup_steps: raise the learning rate linearly from lr / warmup_steps to lr over this many optimizer
            steps: large-batch training with a linearly scaled lr needs it (Goyal et al., 2017).
        lr_schedule: after warmup, ``"constant"`` or ``"cosine"`` (decay to 0 at the Trainer's last step).
        build_in_configure_model: build the VGG in ``configure_model`` instead of here; under hybrid3d
            with pp > 1 it is then built on the meta device and each rank materializes only its stages.
    """

    def __init__(
        self,
        config: VGGConfig | None = None,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"LitVGG(optimizer={optimizer!r}) is not one of {OPTIMIZERS}: pick one of them.")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"LitVGG(lr_schedule={lr_schedule!r}) is not one of {LR_SCHEDULES}: pick one of them.")
        self.config = config or VGGConfig()
        self.model: VGG | None = None if build_in_configure_model else VGG(self.config)
        self.optimizer_name, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay
        self.warmup_steps, self.lr_schedule = warmup_steps, lr_schedule
        # Lightning's sample input, one microbatch of images: pp_balance="profile" times each pipeline layer
        # on it (assign your own microbatch to profile at its size). Its own generator: the global random
        # state, and so the training, is the same with it as without.
        generator = torch.Generator().manual_seed(0)
        side, channels = self.config.image_size, self.config.in_channels
        self.example_input_array = torch.randn(EXAMPLE_MICROBATCH, channels, side, side, generator=generator)

    def configure_model(self) -> None:
        if self.model is None:  # the strategy's context decides the device (meta under pipelining)
            self.model = VGG(self.config)

    def forward(self, images: Tensor) -> Tensor:
        assert self.model is not None, "the VGG is built in configure_model: run it through a Trainer"
        return self.model(images)  # (B, 3, H, W) -> (B, num_classes)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), targets)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        loss = self.loss(self(images), targets)
        # sync_dist: each data-parallel rank saw its own slice of the batch; log the global mean
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        logits = self(images)
        loss = self.loss(logits, targets)
        accuracy = (logits.argmax(dim=-1) == targets).float().mean()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", accuracy, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        loss = self.loss(self(images), targets)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    # ----- the parallel protocol: what hybrid3d needs beyond an ordinary LightningModule -----

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers forward runs, in order: pipeline stages are contiguous runs of them."""
        if self.model is None:
            raise AttributeError("pipeline_layers: the VGG is built in configure_model")
        return self.model.layers()

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Module path -> ParallelStyle on the tp axis: conv channels split in pairs, the head column-then-row."""
        if sequence_parallel:
            raise ValueError("LitVGG has no sequence dimension to split: set sequence_parallel=False.")
        return vgg_tp_plan("model.", self.config)

    def spatial_gather_modules(self) -> list[str]:
        """Under spatial > 1 the convolutions run on strips of the images; the head's input is gathered whole."""
        return ["model.head"]

    def check_parallel_degrees(self, dims: ParallelDims) -> None:
        """Refuse degrees this model cannot split into, before any process group exists."""
        VGG.check_tensor_parallel_config(self.config, dims.tp)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if self.optimizer_name == "adamw":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)
        if self.warmup_steps <= 0 and self.lr_schedule == "constant":
            return optimizer
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 0
        warmup, schedule = self.warmup_steps, self.lr_schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total, schedule))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
