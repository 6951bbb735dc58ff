"""The GPT as an ordinary LightningModule, plus the protocol methods hybrid3d reads (its ordered layers, a
TP plan, a degree check; ``loss`` it has anyway); it runs unchanged under "auto", "ddp", "fsdp" and the
zero strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT, gpt_tp_plan
from lightning_parallel.parallel.mesh import ParallelDims

EXAMPLE_MICROBATCH = 4  # samples in example_input_array


class GPTModule(pl.LightningModule):
    """Next-token prediction with AdamW; weight decay on matrices only (two param groups).

    Args:
        config: the model's shape.
        lr: AdamW learning rate.
        weight_decay: applied to weights of dimension >= 2.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: raise the learning rate linearly from lr / warmup_steps to lr over this many
            optimizer steps (0: constant).
        build_in_configure_model: build the GPT in ``configure_model`` instead of here; under hybrid3d
            with pp > 1 it is then built on the meta device and each rank materializes only its stages.
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.model: RecipeGPT | None = None if build_in_configure_model else RecipeGPT(self.config)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.warmup_steps = warmup_steps
        # Lightning's sample input, one microbatch of token ids: pp_balance="profile" times each pipeline
        # layer on it (assign your own microbatch to profile at its size). Its own generator: the global
        # random state, and so the training, is the same with it as without.
        generator = torch.Generator().manual_seed(0)
        shape = (EXAMPLE_MICROBATCH, self.config.seq_len)
        self.example_input_array = torch.randint(0, self.config.vocab_size, shape, generator=generator)

    def configure_model(self) -> None:
        if self.model is None:  # the strategy's context decides the device (meta under pipelining)
            self.model = RecipeGPT(self.config)

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "the GPT is built in configure_model: run it through a Trainer"
        return self.model(idx)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        loss = self.loss(self(idx), targets)
        # sync_dist: each data-parallel rank saw its own slice of the batch; log the global mean
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        loss = self.loss(self(idx), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        loss = self.loss(self(idx), targets)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    # ----- the parallel protocol: what hybrid3d needs beyond an ordinary LightningModule -----

    def pipeline_layers(self) -> list[torch.nn.Module]:
        """The layers forward runs, in order: pipeline stages are contiguous runs of them."""
        if self.model is None:
            raise AttributeError("pipeline_layers: the GPT is built in configure_model")
        return self.model.layers()

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Module path -> torch ParallelStyle, applied on the tp axis."""
        return gpt_tp_plan("model.", sequence_parallel, self.config.moe_blocks, self.config.n_layer)

    def context_parallel(self, attention: Callable[..., Tensor], positions: Callable[..., Tensor]) -> list[str]:
        """Under cp > 1: the blocks' attention and the embedding's positions switched (:meth:`GPT.context_parallel`)."""
        if self.model is None:
            raise AttributeError("context_parallel: the GPT is built in configure_model")
        return [f"model.{path}" for path in self.model.context_parallel(attention, positions)]

    def attention_heads(self) -> int:
        return self.config.n_head

    def check_parallel_degrees(self, dims: ParallelDims) -> None:
        """Refuse degrees this model cannot split into, before any process group exists."""
        RecipeGPT.check_tensor_parallel_config(self.config, dims.tp)
        cp = dims.cp
        if cp > 1 and self.config.dropout:
            raise ValueError(
                f"cp={cp}: context-parallel attention has no dropout, and the model's attention dropout is "
                f"{self.config.dropout}: set it to 0 (GPTConfig.dropout), or cp=1."
            )

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps)
        if self.warmup_steps <= 0:
            return optimizer
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
