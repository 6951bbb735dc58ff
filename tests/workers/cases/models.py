"""The LightningModules and data the Trainer cases train (cases/gpt.py and the others), each keeping its
micro-batches' losses: the tiny GPT (and a variant with its layers on the module itself), the VGG with BatchNorm,
a classifier with one MoE layer and the README's bring-your-own-model example."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from torch.utils.data import TensorDataset

from lightning_parallel.models import GPTModule, SyntheticTokens
from lightning_parallel.models.gpt import gpt_tp_plan
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.vgg import VGGConfig
from lightning_parallel.parallel.expert import MoE
from lightning_parallel.parallel.optim.muon import MuonAdamW

from .common import DEEP, TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from byo_model import MLPClassifier, teacher_dataset  # noqa: E402  (the README's bring-your-own-model example)


class RecordLosses:
    """Keeps each micro-batch's local loss as the training step returned it, and counts validation samples
    with a torchmetrics metric (its sync must count each sample once, whatever the layout)."""

    losses: list[float]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_samples.update(batch[0].shape[0])
        return super().validation_step(batch, batch_idx)


class RecordingBYO(RecordLosses, MLPClassifier):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.losses = []
        self.val_samples = torchmetrics.SumMetric()


class MoEClassifier(pl.LightningModule):
    """A model that is not the recipe GPT: token features -> linear -> one MoE layer -> mean over tokens -> classes.
    Its MoE layer comes from lightning_parallel as anyone would use it; nothing else is parallel-aware."""

    def __init__(self, lr: float = 1e-3, **moe: object) -> None:
        super().__init__()
        self.lr = lr
        self.inp = torch.nn.Linear(12, 16)
        self.moe = MoE(16, 32, **{"num_experts": 4, "top_k": 2, **moe})
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.moe(torch.nn.functional.gelu(h))
        return self.out(h.mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


class RecordingMoEClassifier(RecordLosses, MoEClassifier):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.losses = []
        self.val_samples = torchmetrics.SumMetric()


def token_classes(num_samples: int) -> TensorDataset:
    """Sequences of 6 feature vectors; the class is the argmax of a fixed projection of their mean."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 6, 12, generator=g)
    teacher = torch.randn(12, 5, generator=g)
    return TensorDataset(x, (x.mean(1) @ teacher).argmax(-1))


class RecordingVGG(RecordLosses, LitVGG):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.losses = []
        self.val_samples = torchmetrics.SumMetric()


def random_images(num_samples: int, size: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(num_samples, 3, size, size, generator=g), torch.randint(0, 10, (num_samples,), generator=g)
    )


class RecordingGPT(RecordLosses, GPTModule):
    """GPTModule recording its losses; optionally returns an optimizer we cannot shard."""

    def __init__(self, optimizer: str = "adamw", **kwargs) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.losses: list[float] = []
        self.val_samples = torchmetrics.SumMetric()
        self.built_on: str | None = None

    def configure_model(self):
        super().configure_model()
        if self.built_on is None:  # the device the strategy had the layers created on
            self.built_on = next(self.model.parameters()).device.type

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.optimizer_name == "sgd":  # linear in the gradient: a wrong gradient scale shows at once
            return torch.optim.SGD(self.parameters(), lr=0.5)
        if self.optimizer_name in ("muon", "muon_bf16"):  # Muon on the matrices, AdamW on the rest; fp32
            # Newton-Schulz for exact parity, or bf16 (torch's) for the bf16 bar
            ns_dtype = "bfloat16" if self.optimizer_name == "muon_bf16" else "float32"
            return MuonAdamW.from_module(self, lr=0.02, ns_dtype=ns_dtype, adamw_lr=self.lr, adamw_eps=self.eps)
        return super().configure_optimizers()


class TopLevelGPT(RecordingGPT):
    """The GPT's layers directly on the LightningModule, head tied to the embedding across them:
    ZeRO-3 has to make the LightningModule itself a unit and route every step through it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        gpt = self.model
        del self.model
        self.embed, self.blocks, self.head = gpt.embed, gpt.blocks, gpt.head

    def configure_model(self):
        pass  # built in __init__

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def tensor_parallel_plan(self, sequence_parallel=False):
        return gpt_tp_plan("", sequence_parallel)


def build_model(case: dict, num_samples: int) -> tuple[pl.LightningModule, TensorDataset]:
    """The case's recording model (case keys model, lr, meta, deep, moe, optimizer, image_size) and its data."""
    if case.get("model") == "vgg":  # BatchNorm: running statistics are buffers every stage must keep right
        size = case.get("image_size", 32)  # spatial splits need a multiple of 32 x spatial
        data = random_images(num_samples, size)
        model = RecordingVGG(
            config=VGGConfig(name="vgg11", width=8, image_size=size),
            lr=case.get("lr", 0.01),
            build_in_configure_model=bool(case.get("meta")),
        )
    elif case.get("model") == "moe_classifier":  # not the recipe GPT: a classifier with one MoE layer
        data = token_classes(num_samples)
        model = RecordingMoEClassifier(lr=case.get("lr", 1e-3), **case.get("moe", {}))
    elif case.get("model") == "byo":
        data = teacher_dataset(num_samples)
        model = RecordingBYO(lr=case.get("lr", 1e-3))
    else:
        data = SyntheticTokens(num_samples=num_samples, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
        model_cls = TopLevelGPT if case.get("model") == "top_level" else RecordingGPT
        # eps 1e-6, not torch's 1e-8: a coordinate whose gradient is at float32 rounding level gets an Adam
        # update of pure rounding noise (one element of 4096 in blocks.4.mlp.proj ended 1.4e-5 apart under
        # pp=2 x tp=2 and 5.4e-6 under Lightning's own ddp at world 4, every other element within 6e-7); that
        # says nothing about a strategy, and a larger eps keeps such coordinates still
        config = DEEP if case.get("deep") else TINY
        if case.get("moe"):  # GPTConfig overrides: moe_experts, moe_top_k, moe_capacity_factor, ...
            config = dataclasses.replace(config, **case["moe"])
        model = model_cls(
            optimizer=case.get("optimizer", "adamw"),
            config=config,
            lr=case.get("lr", 1e-3),
            eps=1e-6,
            build_in_configure_model=bool(case.get("meta")),
        )
    return model, data
