"""What every next-token LightningModule of this package shares (:class:`~lightning_parallel.hf.HFCausalLM`,
:class:`~lightning_parallel.litgpt.LitGPTCausalLM`): the loss, the steps and the optimizer. The subclass holds
the model (``self.model``), its forward and how it reads a batch (``unpack``); the parallel protocol stays with it.
Pure torch + Lightning; no transformers, no litgpt."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts)


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """HF's causal-LM loss: labels shifted one token left here (the last position predicts nothing), token-mean
    cross-entropy over labels that are not -100. ``logits`` (B, T, V) may be split over V (inside
    ``loss_parallel``)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # (B, T)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), shifted.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX
    )


class CausalLM(pl.LightningModule):
    """Next-token training: :func:`causal_lm_loss` per (micro)batch, ``train_loss`` / ``val_loss`` /
    ``test_loss`` logged over the data-parallel ranks, AdamW over the trainable parameters, without decay on those
    of dimension < 2 (biases, norm weights). Override ``configure_optimizers`` for another optimizer.

    Args:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
    """

    def __init__(
        self, lr: float = 3e-4, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8
    ) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """(input_ids, labels, attention_mask or None) of a batch."""
        raise NotImplementedError

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return causal_lm_loss(logits, labels)

    def _step_loss(self, batch: Any) -> Tensor:
        ids, labels, mask = self.unpack(batch)
        output = self(ids) if mask is None else self(ids, attention_mask=mask)
        return self.loss(output, labels)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        # only what trains: a frozen base (LoRA) gets no optimizer state, and no gradient buffer under ZeRO 1-2
        trainable = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # LoRA's factors are all matrices; a pipeline stage holding no adapter keeps one empty group (torch refuses
        # an optimizer without any)
        groups = [g for g in groups if g["params"]] or groups[:1]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps)
