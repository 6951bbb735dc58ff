"""The bad-input catalogue: every way of asking for something that cannot run is refused at once, with a
message that names the setting and the fix, before any process group or worker exists, without a traceback
from inside torch, and without touching what was saved before.

One parametrized test over :data:`CASES`. Each case returns the message the user sees (an exception's text,
a warning, or a recipe's output) and names two phrases of it: the setting and the fix. Most run in this
process (building a strategy or a Trainer, composing a recipe config with Hydra's compose API and calling
the recipe's ``check_config``, calling ``check_model``); the ``proc-`` cases run a recipe as a user would,
with a timeout, to show what the terminal shows. A real checkpoint (a sharded folder saved by a recipe run,
and the same consolidated into one file) lies in place during every case, and its bytes and modification
times are compared before and after.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from recipe_runs import GPT, ROOT, VGG, run
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import AsyncPSStrategy, Hybrid3DStrategy, MoE, ZeroStrategy
from lightning_parallel import checkpoint as checkpoint_cli
from lightning_parallel.models import GPTConfig, GPTModule, LitVGG, VGGConfig
from lightning_parallel.recipes import gpt, vgg
from lightning_parallel.recipes.config import register_configs

register_configs()
CONF = ROOT / "conf"
# ours, Lightning's and Hydra's (a config that does not compose)
ERRORS = (ValueError, TypeError, OSError, pickle.UnpicklingError, HydraException, OmegaConfBaseException)


class Ctx:
    """What a case may use: a fresh folder of its own, and the saved checkpoint that must stay untouched."""

    def __init__(self, tmp: Path, saved: Path) -> None:
        self.tmp, self.saved = tmp, saved
        self.ckpts = saved / "ckpts"  # the recipe run's checkpoint.dir: epoch=0-step=2.ckpt/, last.ckpt/
        self.full = saved / "full.ckpt"  # last.ckpt consolidated into one file

    def file(self, name: str, data: bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(data)
        return path


@dataclass(frozen=True)
class Case:
    id: str
    message: Callable[[Ctx], str]  # what the user sees
    setting: str  # a phrase of it that names the setting
    fix: str  # a phrase of it that names the fix


def raised(fn: Callable[[], object]) -> str:
    """The message of the error ``fn`` raises; it must come from our checks (or Lightning's), not from torch."""
    try:
        fn()
    except ERRORS as err:
        where = traceback.extract_tb(err.__traceback__)[-1].filename
        assert "/torch/" not in where, f"raised from inside torch ({where}): {err}"
        cause = f" {err.__cause__}" if err.__cause__ is not None else ""  # Hydra puts the reason here
        return f"{err}{cause}"
    raise AssertionError("accepted without an error")


def warned(fn: Callable[[], object]) -> str:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    assert seen, "accepted without a warning"
    return " | ".join(str(w.message) for w in seen)


# ----- strategy arguments -----


def hybrid(**kwargs) -> Callable[[Ctx], str]:
    return lambda ctx: raised(lambda: Hybrid3DStrategy(**kwargs))


def zero(**kwargs) -> Callable[[Ctx], str]:
    return lambda ctx: raised(lambda: ZeroStrategy(**kwargs))


def trainer(strategy, devices: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)


def on_devices(devices: int, **kwargs) -> Callable[[Ctx], str]:
    return lambda ctx: raised(lambda: trainer(Hybrid3DStrategy(**kwargs), devices))


STRATEGY_CASES = [
    Case("h3d-degrees-not-world", on_devices(4, dp=3, tp=2), "dp(3) * tp(2) = 6 != world_size(4)", "use dp='auto'"),
    Case("h3d-auto-dp-indivisible", on_devices(3, tp=2), "dp='auto' needs world_size(3)", "product divides 3"),
    Case("h3d-tp-zero", hybrid(tp=0), "tp=0 is not a parallel degree", "set tp to a positive integer"),
    Case("h3d-pp-negative", hybrid(pp=-1), "pp=-1 is not a parallel degree", "set pp to a positive integer"),
    Case("h3d-tp-not-int", hybrid(tp=1.5), "tp=1.5 is not a parallel degree", "set tp to a positive integer"),
    Case("h3d-dp-string", hybrid(dp="all"), "dp='all' is not a parallel degree", "positive integer or 'auto'"),
    Case(
        "h3d-zero-stage-4", hybrid(zero_stage=4), "zero_stage=4 is not a ZeRO stage", "set zero_stage to 0, 1, 2 or 3"
    ),
    Case("h3d-offload-stage-1", hybrid(zero_stage=1, offload=True), "offload=True needs sharded", "or offload=False"),
    Case("h3d-ep-not-dividing-dp", hybrid(dp=4, ep=3), "ep=3 must divide dp=4", "divisors of 4"),
    Case(
        "h3d-ep-not-dividing-auto-dp",
        on_devices(4, tp=2, ep=4),
        "ep=4 must divide the data-parallel degree dp=2",
        "divisors of 2",
    ),
    Case("h3d-ep-zero", hybrid(ep=0), "ep=0 is not a parallel degree", "set ep to a positive integer"),
    Case(
        "h3d-dp-shard-not-dividing-dp",
        hybrid(dp=4, dp_shard=3, zero_stage=3),
        "dp_shard=3 must divide dp=4",
        "divisors of 4",
    ),
    Case(
        "h3d-dp-shard-not-dividing-auto-dp",
        on_devices(4, dp_shard=3, zero_stage=3),
        "dp_shard=3 must divide dp=4",
        "dp_shard=None to shard over all of dp",
    ),
    Case(
        "h3d-dp-shard-zero", hybrid(dp_shard=0, zero_stage=3), "dp_shard=0 is not a parallel degree", "positive integer"
    ),
    Case(
        "h3d-dp-shard-zero0", hybrid(dp_shard=2), "dp_shard=2 (HSDP) with zero_stage=0", "set zero_stage to 1, 2 or 3"
    ),
    Case(
        "h3d-dp-shard-with-ep",
        hybrid(dp=4, ep=2, dp_shard=2, zero_stage=2),
        "dp_shard=2 (HSDP) with ep=2",
        "set ep=1",
    ),
    Case("zero-dp-shard-zero", zero(stage=3, dp_shard=0), "dp_shard=0 is not a parallel degree", "or None"),
    Case(
        "h3d-mesh-not-fitting-node",
        lambda ctx: raised(lambda: trainer(Hybrid3DStrategy(tp=2, dp_shard=2, zero_stage=3), 2, num_nodes=4)),
        "tp(2) * dp_shard(2) = 4 does not divide the node size 2",
        "change the processes per node",
    ),
    Case("h3d-cp-zero", hybrid(cp=0), "cp=0 is not a parallel degree", "set cp to a positive integer"),
    Case("h3d-cp-mode-unknown", hybrid(cp=2, cp_mode="star"), "cp_mode='star' is unknown", "one of ring, ulysses"),
    Case("h3d-cp-with-ep", hybrid(dp=2, ep=2, cp=2), "cp=2 with ep=2", "Set cp=1 or ep=1"),
    Case(
        "h3d-cp-not-dividing-world",
        on_devices(4, cp=3),
        "dp='auto' needs world_size(4) divisible by pp(1) * cp(3) * tp(1) = 3",
        "product divides 4",
    ),
    Case(
        "h3d-cp-mode-without-cp",
        lambda ctx: warned(lambda: Hybrid3DStrategy(cp_mode="ulysses")),
        "cp_mode='ulysses' only applies with cp > 1",
        "ignored at cp=1",
    ),
    Case("h3d-spatial-zero", hybrid(spatial=0), "spatial=0 is not a parallel degree", "set spatial to a positive"),
    Case("h3d-spatial-with-cp", hybrid(spatial=2, cp=2), "spatial=2 with cp=2", "Set spatial=1 or cp=1"),
    Case("h3d-spatial-with-tp", hybrid(spatial=2, tp=2), "spatial=2 with tp=2: not supported", "Set tp=1 or spatial=1"),
    Case("h3d-spatial-with-pp", hybrid(spatial=2, pp=2), "spatial=2 with pp=2: not supported", "Set pp=1 or spatial=1"),
    Case(
        "h3d-spatial-not-dividing-world",
        on_devices(4, spatial=3),
        "dp='auto' needs world_size(4) divisible by pp(1) * spatial(3) * tp(1) = 3",
        "product divides 4",
    ),
    Case("zero-refuses-tp", zero(stage=2, tp=2), "ZeroStrategy does not take tp", "Hybrid3DStrategy(zero_stage=...)"),
    Case(
        "bucket-without-overlap",
        lambda ctx: warned(lambda: Hybrid3DStrategy(bucket_mb=1)),
        "bucket_mb only applies",
        "overlap_grad_reduce=True",
    ),
    Case(
        "overlap-with-zero3",
        lambda ctx: warned(lambda: Hybrid3DStrategy(zero_stage=3, overlap_grad_reduce=True)),
        "ignored with zero_stage=3",
        "Set overlap_grad_reduce=False",
    ),
    Case("grad-compression-unknown", zero(stage=2, grad_compression="int8"), "grad_compression='int8'", "'bf16'"),
    Case(
        "powersgd-rank-zero",
        zero(stage=2, grad_compression="powersgd", powersgd_rank=0),
        "powersgd_rank=0",
        "a positive integer",
    ),
    Case(
        "powersgd-with-zero3",
        zero(stage=3, grad_compression="powersgd"),
        "zero_stage=3 (zero3)",
        "zero_stage=2 (zero2)",
    ),
    Case(
        "powersgd-with-overlap",
        hybrid(grad_compression="powersgd", overlap_grad_reduce=True),
        "grad_compression='powersgd' reduces once after backward",
        "set overlap_grad_reduce=False",
    ),
    Case("moe-top-k-above-experts", lambda ctx: raised(lambda: MoE(8, 16, 4, top_k=5)), "top_k=5", "k <= the experts"),
    Case(
        "moe-capacity-zero",
        lambda ctx: raised(lambda: MoE(8, 16, 4, capacity_factor=0)),
        "capacity_factor=0",
        "(1.25 is common) or None",
    ),
    Case("moe-gpt-top-k", lambda ctx: raised(lambda: GPTConfig(moe_experts=2, moe_top_k=3)), "top_k=3", "k <= the"),
    Case(
        "h3d-schedule-unknown", hybrid(pp=2, pp_schedule="fast"), "pp_schedule='fast' is unknown", "one of gpipe, 1f1b"
    ),
    Case("h3d-balance-unknown", hybrid(pp=2, pp_balance="magic"), "pp_balance='magic' is unknown", "one of uniform"),
    Case(
        "h3d-microbatches-zero", hybrid(pp=2, microbatches=0), "microbatches=0 is not", "set microbatches to a positive"
    ),
    Case(
        "h3d-microbatches-below-stages", hybrid(pp=4, microbatches=2), "microbatches=2 < pp=4", "microbatch per stage"
    ),
    Case(
        "h3d-microbatches-not-multiple",
        hybrid(pp=2, microbatches=5, pp_schedule="interleaved_1f1b"),
        "microbatches=5 must be a multiple of 2",
        "set microbatches to a multiple of 2",
    ),
    Case(
        "h3d-virtual-stages-1f1b",
        hybrid(pp=2, pp_virtual_stages=3),
        "pp_virtual_stages=3 does not fit",
        "leave pp_virtual_stages unset",
    ),
    Case(
        "h3d-virtual-stages-one",
        hybrid(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=1),
        "pp_virtual_stages=1",
        "set it to 2 or more",
    ),
    Case(
        "h3d-ac-unknown", hybrid(activation_checkpointing="partial"), "checkpointing='partial' is unknown", "none, full"
    ),
    Case(
        "h3d-ac-bool", hybrid(activation_checkpointing=True), "activation_checkpointing=True is unknown", "none, full"
    ),
    Case(
        "h3d-selective-zero-bubble",
        hybrid(pp=2, pp_schedule="zero_bubble", activation_checkpointing="selective"),
        "activation_checkpointing='selective' cannot run under pp_schedule='zero_bubble'",
        "Use activation_checkpointing='full' or another pp_schedule",
    ),
    Case("h3d-sp-string", hybrid(tp=2, sequence_parallel="yes"), "sequence_parallel='yes'", "sequence_parallel=False"),
    Case(
        "h3d-sp-without-tp", lambda ctx: warned(lambda: Hybrid3DStrategy(sequence_parallel=True)), "tp=1", "Set tp > 1"
    ),
    Case("h3d-checkpoint-format", hybrid(checkpoint_format="zip"), "checkpoint_format='zip'", "use 'sharded'"),
    Case("zero-stage-0", zero(stage=0), "stage=0 is not a ZeRO stage", "set stage to 1, 2 or 3"),
    Case("zero-stage-string", zero(stage="3"), "stage='3' is not a ZeRO stage", "set stage to 1, 2 or 3"),
    Case("zero-offload-stage-1", zero(stage=1, offload=True), "offload=True needs sharded", "set stage=2 or stage=3"),
    Case(
        "zero-offload-string", zero(stage=2, offload="yes"), "offload='yes' must be True or False", "set offload=True"
    ),
    Case(
        "zero-reshard-string", zero(stage=3, reshard_after_forward="no"), "forward='no'", "reshard_after_forward=True"
    ),
    Case("zero-ac-unknown", zero(stage=3, activation_checkpointing="partial"), "='partial' is unknown", "none, full"),
    Case(
        "zero2-one-process", lambda ctx: raised(lambda: trainer("zero2", 1)), "world size is 1", "at least 2 processes"
    ),
    Case(
        "zero3-fp16-weights",
        lambda ctx: raised(lambda: trainer("zero3", 2, precision="16-true")),
        "precision='16-true' is not supported",
        "set precision to one of 32-true",
    ),
    Case("registered-name-unknown", lambda ctx: raised(lambda: trainer("zero4", 2)), "'zero4'", "Example choices"),
]


# ----- the bring-your-own-model protocol -----


class NoProtocol(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


class LayersOnly(NoProtocol):
    def pipeline_layers(self) -> list[nn.Module]:
        return [self.layer]


class Blocks(pl.LightningModule):
    """Two MLP blocks whose hidden width (3) tp=2 cannot split, with a plan."""

    def __init__(self, plan: dict) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 4)) for _ in range(2))
        self.plan = plan

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict:
        return self.plan


class Scale(nn.Module):
    """A layer with a weight but no reset_parameters(): nothing initializes it after a meta build."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


class MetaBuilt(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList([nn.Linear(4, 4), Scale()])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


class GatherOnly(LayersOnly):
    """Names a gather module, but has no convolution before it."""

    def spatial_gather_modules(self) -> list[str]:
        return ["layer"]


def checked(model_fn: Callable[[], pl.LightningModule], devices: int, **kwargs) -> Callable[[Ctx], str]:
    """What ``Trainer.fit`` refuses before Lightning's launcher starts the other ranks (``check_model``)."""
    return lambda ctx: raised(lambda: trainer(Hybrid3DStrategy(**kwargs), devices).strategy.check_model(model_fn()))


def gpt_model(**sizes) -> GPTModule:
    return GPTModule(GPTConfig(**{"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32, **sizes}))


MODEL_CASES = [
    Case(
        "cp-sequence-indivisible",
        checked(lambda: gpt_model(seq_len=12), 4, cp=4),
        "cp=4 splits each sequence into 2 * cp = 8 equal chunks",
        "choose cp so that 2 * cp divides 12",
    ),
    Case(
        "cp-ulysses-heads",
        checked(lambda: gpt_model(n_head=6, d_model=48), 4, cp=4, cp_mode="ulysses"),
        "n_head = 6 does not divide by cp=4",
        "or cp_mode='ring'",
    ),
    Case(
        "cp-ulysses-heads-under-tp",
        checked(lambda: gpt_model(), 8, cp=4, tp=2, cp_mode="ulysses"),
        "n_head / tp = 4 / 2 = 2 does not divide by cp=4",
        "or cp_mode='ring'",
    ),
    Case("cp-attention-dropout", checked(lambda: gpt_model(dropout=0.1), 2, cp=2), "dropout is 0.1", "set it to 0"),
    Case("cp-without-attention", checked(LayersOnly, 2, cp=2), "cp=2 needs LayersOnly.context_parallel", "or set cp=1"),
    Case(
        "spatial-without-gather-modules",
        checked(LayersOnly, 2, spatial=2),
        "spatial=2 needs LayersOnly.spatial_gather_modules()",
        "or set spatial=1",
    ),
    Case("spatial-without-convs", checked(GatherOnly, 2, spatial=2), "GatherOnly has none", "Set spatial=1"),
    Case(
        "spatial-height-indivisible",
        checked(lambda: LitVGG(VGGConfig(width=8, image_size=64)), 4, spatial=4),
        "image height 64 must be a multiple of spatial x the downsampling",
        "Use images whose height is a multiple of 128 (model.image_size)",
    ),
    Case(
        "pp-without-protocol", checked(NoProtocol, 2, pp=2), "needs NoProtocol.pipeline_layers and .loss()", "Add them"
    ),
    Case("pp-without-loss", checked(LayersOnly, 2, pp=2), "pp=2 needs LayersOnly.loss()", "or set pp=1"),
    Case("tp-without-plan", checked(NoProtocol, 2, tp=2), "needs NoProtocol.tensor_parallel_plan", "or set tp=1"),
    Case(
        "tp-plan-missing-module",
        checked(lambda: Blocks({"blocks.*.3": ColwiseParallel()}), 2, tp=2),
        "tensor_parallel_plan entry 'blocks.*.3' names no module of Blocks",
        "fix the path",
    ),
    Case(
        "tp-plan-linear-indivisible",
        checked(lambda: Blocks({"blocks.*.0": ColwiseParallel(), "blocks.*.1": RowwiseParallel()}), 2, tp=2),
        "tp=2 does not divide blocks.0.0.out_features=3",
        "choose tp among the divisors of 3",
    ),
    Case("tp-gpt-heads", checked(lambda: gpt_model(n_head=6, d_model=48), 4, tp=4), "tp=4 does not divide", "among"),
    Case(
        "pp-more-stages-than-layers",
        checked(lambda: GPTModule(GPTConfig(n_layer=1), build_in_configure_model=True), 4, pp=4),
        "needs 4 pipeline stages but the model has only 3 pipeline layers",
        "lower pp",
    ),
    Case("meta-layer-without-reset", checked(MetaBuilt, 2, pp=2), "Scale is built on the meta", "a reset_parameters()"),
    Case(
        "ep-without-moe",
        checked(lambda: GPTModule(GPTConfig(), build_in_configure_model=True), 2, ep=2),
        "ep=2 splits the experts of MoE layers",
        "or set ep=1",
    ),
    Case(
        "ep-not-dividing-experts",
        checked(lambda: GPTModule(GPTConfig(moe_experts=6), build_in_configure_model=True), 4, dp=4, ep=4),
        "ep=4 does not divide the 6 experts of model.blocks.1.mlp",
        "divisors of 6",
    ),
]


# ----- recipe overrides (Hydra's compose API, then the recipe's check_config, as the recipes do) -----


def recipe(name: str, *overrides: str | Callable[[Ctx], str]) -> Callable[[Ctx], str]:
    """``python recipes/<name>.py *overrides`` up to the checks before any worker; an override may be a
    function of the case's context (for paths)."""

    def message(ctx: Ctx) -> str:
        args = [o(ctx) if callable(o) else o for o in overrides]

        def check() -> None:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose(config_name=name, overrides=args)
            (gpt if name == "train_gpt" else vgg).check_config(cfg)

        return raised(check)

    return message


def G(*overrides):  # noqa: N802  (short, like the command line it stands for)
    return recipe("train_gpt", *overrides)


def V(*overrides):  # noqa: N802
    return recipe("train_vgg", *overrides)


H3D = "strategy=hybrid3d"
PAGE = "docs/reference/strategy-keys.md lists each strategy's keys"  # each strategy schema's refusal names it
RECIPE_CASES = [
    Case("gpt-unknown-key", G("strategy.tpp=2"), "Key 'tpp' not in 'the keys of strategy=ddp", PAGE),
    Case("gpt-added-unknown-key", G("+strategy.tpp=2"), "strategy.tpp is not a setting", "fix its spelling"),
    Case("gpt-wrong-type", G(H3D, "strategy.tp=two"), "strategy.tp=two", "could not be converted to Integer"),
    Case("gpt-unknown-strategy-option", G("strategy=fsdp9"), "'strategy/fsdp9'", "Available options in 'strategy'"),
    Case("gpt-unknown-strategy-name", G("strategy.name=fsdp9"), "strategy='fsdp9' is unknown", "use ddp, zero1"),
    Case("gpt-unknown-precision-option", G("precision=fp4"), "'precision/fp4'", "Available options in 'precision'"),
    Case(
        "gpt-precision-not-for-zero",
        G("strategy=zero2", "trainer.devices=2", "precision.value=16-true"),
        "precision.value='16-true' is not supported by strategy=zero2",
        "one of 32-true, bf16-mixed, 16-mixed, bf16-true",
    ),
    Case("gpt-tp-not-dividing-heads", G(H3D, "strategy.tp=3", "trainer.devices=6"), "GPTConfig.n_head=8", "divisors"),
    Case(
        "gpt-ep-dense-model",
        G(H3D, "strategy.ep=2", "trainer.devices=2"),
        "strategy.ep=2 splits the experts",
        "use model=gpt_moe_tiny",
    ),
    Case(
        "gpt-ep-not-dividing-experts",
        G(H3D, "model=gpt_moe_tiny", "model.moe_experts=6", "strategy.ep=4", "trainer.devices=4"),
        "strategy.ep=4 does not divide model.moe_experts=6",
        "divisors of 6",
    ),
    Case(
        "gpt-moe-capacity-negative",
        G("model=gpt_moe_tiny", "model.moe_capacity_factor=-1"),
        "capacity_factor=-1",
        "or None (dropless)",
    ),
    Case("gpt-unknown-optimizer", G("optimizer.name=lion"), "optimizer='lion'", "pick one of adamw, sgd, muon"),
    Case("gpt-muon-fp16", G("optimizer=muon", "precision=16-mixed"), "optimizer=muon with precision=16", "bf16-mixed"),
    Case(
        "gpt-muon-zero1-tp",
        G(H3D, "optimizer=muon", "strategy.zero_stage=1", "strategy.tp=2", "trainer.devices=2"),
        "optimizer=muon with strategy=hybrid3d (zero_stage=1, tp=2)",
        "strategy.zero_stage=3",
    ),
    Case(
        "vgg-tp-not-dividing-channels",
        V(H3D, "strategy.tp=2", "trainer.devices=2", "model.width=3"),
        "tp=2 does not divide features.0.conv",
        "or change VGGConfig.width",
    ),
    Case(
        "vgg-spatial-image-indivisible",
        V(H3D, "strategy.spatial=4", "trainer.devices=4", "model.image_size=64"),
        "spatial=4 splits each image into 4 strips",
        "a multiple of 128 (model.image_size)",
    ),
    Case(
        "vgg-spatial-with-tp",
        V(H3D, "strategy.spatial=2", "strategy.tp=2", "trainer.devices=4"),
        "spatial=2 with tp=2: not supported",
        "Set tp=1 or spatial=1",
    ),
    Case(
        "gpt-degrees-not-world",
        G(H3D, "strategy.dp=2", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"),
        "pp(2) * dp(2) * tp(2) = 8 != world_size(4)",
        "set the degrees so their product is 4",
    ),
    Case(
        "gpt-pp-more-than-layers",
        G(H3D, "strategy.pp=4", "trainer.devices=4", "model.n_layer=1"),
        "strategy.pp=4 needs 4 pipeline stages but the model has only 3",
        "lower pp",
    ),
    Case(
        "vgg-virtual-stages-more-than-layers",
        V(
            H3D,
            "strategy.pp=2",
            "trainer.devices=2",
            "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pipeline.virtual_stages=8",
        ),
        "needs 16 pipeline stages but the model has only 9",
        "lower pp (or the virtual stages per rank)",
    ),
    Case(
        "gpt-global-batch-not-dp",
        G(H3D, "strategy.tp=2", "trainer.devices=8", "data.global_batch_size=6"),
        "data.global_batch_size=6 does not split over dp=4",
        "make it a multiple of 4",
    ),
    Case(
        "gpt-microbatches-not-dividing",
        G(H3D, "strategy.pp=2", "trainer.devices=2", "strategy.microbatches=3"),
        "strategy.microbatches=3 does not divide the 32 samples",
        "pick a divisor of it",
    ),
    Case("gpt-global-batch-negative", G("data.global_batch_size=-32"), "global_batch_size=-32", "must be positive"),
    Case("gpt-devices-zero", G("trainer.devices=0"), "trainer.devices=0", "set trainer.devices to 1 or more"),
    Case("gpt-nodes-zero", G("trainer.num_nodes=0"), "trainer.num_nodes=0", "set trainer.num_nodes to 1 or more"),
    Case(
        "gpt-hsdp-not-fitting-node",
        G(
            H3D,
            "strategy.tp=2",
            "strategy.dp_shard=2",
            "strategy.zero_stage=3",
            "trainer.devices=2",
            "trainer.num_nodes=4",
        ),
        "tp(2) * dp_shard(2) = 4 does not divide the node size 2",
        "Choose degrees whose product divides 2",
    ),
    Case(
        "gpt-hsdp-dp-shard-not-dividing",
        G(H3D, "strategy.dp_shard=3", "strategy.zero_stage=3", "trainer.devices=4"),
        "dp_shard=3 must divide dp=4",
        "choose dp_shard among the divisors of 4",
    ),
    Case("gpt-accumulate-zero", G("trainer.accumulate_grad_batches=0"), "accumulate_grad_batches=0", "to 1 or more"),
    Case("gpt-max-steps-zero", G("trainer.max_steps=0"), "trainer.max_steps=0", "set trainer.max_steps to 1 or more"),
    Case("gpt-logger-unknown", G("trainer.logger=wandb"), "trainer.logger='wandb' is unknown", "csv, tensorboard"),
    Case("gpt-zero-on-one-device", G("strategy=zero2"), "strategy=zero2 shards over processes", "to 2 or more"),
    Case(
        "gpt-microbatches-without-hybrid",
        G("strategy=zero2", "trainer.devices=2", "strategy.microbatches=4"),
        "Key 'microbatches' not in 'the keys of strategy=zero1..3",
        "set strategy=hybrid3d for pp, tp, cp, ep, spatial, microbatches",
    ),
    Case(
        "gpt-sp-without-hybrid",
        G("strategy=zero3", "trainer.devices=2", "strategy.tensor.sequence_parallel=true"),
        "Could not override 'strategy.tensor.sequence_parallel'",
        "set strategy=hybrid3d for pp, tp, cp, ep, spatial, microbatches, pp_schedule, fault_tolerance and the "
        "pipeline, tensor",
    ),
    Case(
        "gpt-strategy-name-without-preset",
        G("strategy.name=hybrid3d", "trainer.devices=2"),
        "strategy.name=hybrid3d with another strategy's keys",
        "pick the preset with strategy=hybrid3d",
    ),
    Case("gpt-ac-unknown", G("strategy.activation_checkpointing=x"), "activation_checkpointing='x'", "none, full"),
    Case("gpt-heads-not-dividing-width", G("model.n_head=3"), "multiple of n_head(3)", "change one of them"),
    Case("gpt-val-fraction", G("data.val_fraction=1.5"), "data.val_fraction=1.5", "data.val_fraction=0.05"),
]


# ----- data paths -----


Override = Callable[[Ctx], str]
CIFAR = "data=cifar10"


def at(name: str, data: bytes | None = None, key: str = "data.path") -> Override:
    """``key=`` a path in the case's folder; with ``data``, a file written there first."""
    return lambda ctx: f"{key}={ctx.file(name, data) if data is not None else ctx.tmp / name}"


def saved(key: str, name: str) -> Override:
    """``key=`` a path inside the saved checkpoint's folder."""
    return lambda ctx: f"{key}={ctx.saved / name}"


def cut_copy(name: str) -> Override:
    """``ckpt_path=`` a copy of a saved checkpoint file cut after 4 KiB (an interrupted copy)."""
    return lambda ctx: f"ckpt_path={ctx.file(name, (ctx.saved / name).read_bytes()[:4096])}"


def cut(damaged: str) -> Override:
    """``data.path=`` a CIFAR-10 folder in the real format (6 small batches) with ``damaged`` cut in half."""

    def override(ctx: Ctx) -> str:
        folder = ctx.tmp / "cifar-10-batches-py"
        folder.mkdir()
        rng = np.random.default_rng(0)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), b"labels": list(range(10))}
            data = pickle.dumps(batch, protocol=4)
            (folder / name).write_bytes(data[: len(data) // 2] if name == damaged else data)
        return f"data.path={ctx.tmp}"

    return override


DATA_CASES = [
    Case("vgg-cifar-folder-missing", V(CIFAR, at("nowhere")), "is not a folder", "point it at the cifar-10-batches-py"),
    Case("vgg-cifar-batch-missing", V(CIFAR, at(".")), "has no test_batch", "point it at the cifar-10-batches-py"),
    Case("vgg-cifar-batch-cut-short", V(CIFAR, cut("data_batch_3")), "data_batch_3 is not a readable", "extract"),
    Case("gpt-text-file-missing", G(at("corpus.txt")), "corpus.txt' is not a file", "give the path of a local text"),
    Case("gpt-text-file-empty", G(at("empty.txt", b"")), "holds 0 tokens", "use a longer file"),
    Case("gpt-tokens-odd-bytes", G("data=tokens", at("ids.bin", bytes(201))), "odd number of bytes", "use data=text"),
    Case("gpt-tokens-without-path", G("data=tokens"), "data=tokens needs data.path=FILE", "uint16 token ids"),
]


# ----- checkpoint paths (a real saved checkpoint lies in place: it must stay untouched) -----


def cli(command: str, *names: str) -> Callable[[Ctx], str]:
    """``python -m lightning_parallel.checkpoint command`` on paths in the saved folder: status 2, the error
    on stderr."""

    def message(ctx: Ctx) -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = checkpoint_cli.main([command, *(str(ctx.saved / n) for n in names)])
        assert status == 2, f"exit status {status}"
        return err.getvalue()

    return message


CKPT_CASES = [
    Case("ckpt-path-missing", G(saved("ckpt_path", "ckpts/step9.ckpt")), "step9.ckpt' does not exist", "give a saved"),
    Case(
        "ckpt-path-folder-not-checkpoint",
        G(saved("ckpt_path", "ckpts")),
        "is a folder but not a sharded",
        "a save wrote",
    ),
    Case(
        "ckpt-path-file-not-checkpoint",
        G(at("notes.txt", b"fine", "ckpt_path")),
        "not a checkpoint file",
        "a save wrote",
    ),
    Case("ckpt-path-file-cut-short", G(cut_copy("full.ckpt")), "full.ckpt' is not a checkpoint file", "a save wrote"),
    Case("ckpt-last-without-dir", G("ckpt_path=last"), "ckpt_path=last looks in checkpoint.dir", "checkpoint=periodic"),
    Case(
        "ckpt-keep-last-zero",
        G("checkpoint=periodic", saved("checkpoint.dir", "ckpts"), "checkpoint.keep_last=0"),
        "checkpoint.keep_last=0 keeps no step checkpoints",
        "set it to 1 or more",
    ),
    Case(
        "ckpt-every-n-steps-zero",
        G(saved("checkpoint.dir", "ckpts")),
        "checkpoint.every_n_steps=0 would save nothing",
        "set checkpoint.every_n_steps to a positive step count",
    ),
    Case(
        "strategy-load-folder-not-checkpoint",
        lambda ctx: raised(lambda: Hybrid3DStrategy().load_checkpoint(ctx.ckpts)),
        "is a folder but not a sharded checkpoint",
        "give the folder a save wrote",
    ),
    Case(
        "cli-consolidate-onto-itself",
        cli("consolidate", "full.ckpt", "full.ckpt"),
        "overwrite its input",
        "another OUT",
    ),
    Case("cli-info-not-checkpoint", cli("info", "ckpts"), "is neither a checkpoint file nor a sharded", "a save wrote"),
]


# ----- as a user sees it: the recipe in a subprocess (config errors: no traceback, no worker started) -----


def proc(script: Path, *overrides: str | Callable[[Ctx], str]) -> Callable[[Ctx], str]:
    def message(ctx: Ctx) -> str:
        args = [o(ctx) if callable(o) else o for o in overrides]
        result = run(ctx.tmp, script, *args, f"hydra.run.dir={ctx.tmp / 'run'}", timeout=120, ok=False)
        output = result.stdout + result.stderr
        assert result.returncode != 0, output[-3000:]
        assert "Initializing distributed" not in output and not (ctx.tmp / "run" / "metrics.json").exists()
        assert "Traceback" not in output and 'File "' not in output, output[-3000:]  # the message alone
        return output

    return message


PROC_CASES = [
    Case("proc-gpt-unknown-key", proc(GPT, "strategy.tpp=2"), "full_key: strategy.tpp", PAGE),
    Case(
        "proc-gpt-text-file-missing",
        proc(GPT, "strategy=zero2", "trainer.devices=2", at("corpus.txt")),
        "corpus.txt' is not a file",
        "give the path of a local text or token file",
    ),
    Case(
        "proc-vgg-cifar-batch-cut-short",
        proc(VGG, "strategy=zero2", "trainer.devices=2", CIFAR, cut("data_batch_5")),
        "data_batch_5 is not a readable CIFAR-10 batch",
        "extract cifar-10-python.tar.gz again",
    ),
    Case(
        "proc-gpt-resume-from-non-checkpoint",
        proc(
            GPT,
            "strategy=zero2",
            "trainer.devices=2",
            "checkpoint=periodic",
            saved("checkpoint.dir", "ckpts"),
            at("w.txt", b"w", "ckpt_path"),
        ),
        "w.txt' is not a checkpoint file",
        "give a file or folder a save wrote",
    ),
]

ASYNC = ("strategy=async_ps", "trainer.devices=3")
ASYNC_PS_CASES = [
    Case(
        "async-servers-zero",
        lambda ctx: raised(lambda: AsyncPSStrategy(num_servers=0)),
        "num_servers=0 must be a positive integer",
        "set num_servers=1",
    ),
    Case(
        "async-staleness-negative",
        lambda ctx: raised(lambda: AsyncPSStrategy(staleness=-1)),
        "staleness=-1 must be an integer >= 0",
        "set e.g. staleness=4",
    ),
    Case(
        "async-servers-fill-world",
        lambda ctx: raised(lambda: trainer(AsyncPSStrategy(num_servers=2), 2)),
        "num_servers=2 leaves no worker in a world of 2",
        "set num_servers to at most 1",
    ),
    Case(
        "async-half-weights",
        lambda ctx: raised(lambda: trainer(AsyncPSStrategy(), 3, precision="16-true")),
        "precision='16-true' is not supported by strategy='async_ps'",
        "use precision='32-true' or 'bf16-mixed'",
    ),
    Case(
        "async-recipe-servers-fill",
        G("strategy=async_ps", "trainer.devices=2", "strategy.num_servers=2"),
        "strategy.num_servers=2 leaves no worker",
        "set strategy.num_servers to at most 1",
    ),
    Case(
        "async-recipe-fp16",
        G(*ASYNC, "precision=16-mixed"),
        "precision=16-mixed is not supported by strategy=async_ps",
        "use precision=32-true or precision=bf16-mixed",
    ),
    Case(
        "async-recipe-accumulate",
        G(*ASYNC, "trainer.accumulate_grad_batches=2"),
        "trainer.accumulate_grad_batches=2 is not supported by strategy=async_ps",
        "set it to 1",
    ),
    Case(
        "async-recipe-with-zero",
        G(*ASYNC, "strategy.zero_stage=2"),
        "Key 'zero_stage' not in 'the keys of strategy=async_ps",
        "set strategy=zero1..3 or hybrid3d for the others",
    ),
    Case(
        "async-key-without-async",
        G("strategy=zero2", "trainer.devices=2", "strategy.staleness=2"),
        "Key 'staleness' not in 'the keys of strategy=zero1..3",
        "strategy=async_ps for num_servers and staleness",
    ),
]
CASES = STRATEGY_CASES + ASYNC_PS_CASES + MODEL_CASES + RECIPE_CASES + DATA_CASES + CKPT_CASES + PROC_CASES


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint: a sharded folder from a 2-step recipe run (hybrid3d, one process), and the same
    consolidated into one file."""
    root = tmp_path_factory.mktemp("saved")
    tiny = ["model.n_layer=1", "model.d_model=32", "trainer.limit_val_batches=0", "sample_tokens=0"]
    save = ["checkpoint=periodic", "checkpoint.every_n_steps=2", f"checkpoint.dir={root / 'ckpts'}"]
    args = [GPT, "strategy=hybrid3d", "trainer=debug", "trainer.max_steps=2", "trainer.logger=none", *tiny, *save]
    run(root, *args, f"hydra.run.dir={root / 'run'}", timeout=300)
    checkpoint_cli.consolidate(root / "ckpts" / "last.ckpt", root / "full.ckpt")
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, modification time (ns) and a digest of its bytes."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and "run" not in p.relative_to(root).parts)
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, _digest(p)) for p in files}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_catalogue_is_large_and_its_ids_are_unique():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_the_setting_and_the_fix(case: Case, saved_checkpoint: Path, tmp_path: Path):
    saved = saved_checkpoint
    before = snapshot(saved)
    assert {"ckpts/last.ckpt/meta.pt", "full.ckpt"} <= set(before)  # the real checkpoint is in place
    message = case.message(Ctx(tmp_path, saved))
    assert case.setting in message, f"the message does not name the setting ({case.setting!r}): {message}"
    assert case.fix in message, f"the message does not name the fix ({case.fix!r}): {message}"
    assert snapshot(saved) == before, "a refused input changed what was saved"
    assert not dist.is_initialized(), "a bad input must be refused before any process group exists"
