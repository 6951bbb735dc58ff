"""Worker: trains the tiny GPT under one strategy for a list of cases; writes rank<N>.json (+ params).

Run by tests/harness.py on N processes (or on one for the single-process reference). One launch runs
several cases in sequence so the process start-up is paid once.

Case keys: name, steps, global_batch, accumulate, clip, precision, seed, save (checkpoint path after
fit; weights_only: without optimizer states), resume (ckpt_path for fit), memory (measure model-state bytes
after the last step), validate,
optimizer ("adamw" or "lbfgs"), expect_error (record the exception instead of failing), model ("gpt",
"top_level", "byo": the README's bring-your-own-model example, or "vgg": BatchNorm), meta (build the GPT or VGG
in configure_model), deep (6 blocks instead of 2), sync_bn ("trainer": Trainer(sync_batchnorm=True), "plugin":
Trainer(plugins=[DataParallelSyncBatchNorm()])), inject_inf (the global step whose gradient gets an inf on rank
inject_rank, default 0, in one element of its first parameter's local gradient: an fp16 overflow seen by one
rank); with a precision set, the loss scale and a checksum of this rank's parameters are recorded per step.

Also: image_size (VGG: the random images' height and width, default 32), activation_memory (the training batch
whose activation bytes ActivationMemoryMonitor records, 0: first).
--accelerator (default cpu): "gpu" under tests/gpu/ (NCCL, one device per rank); every case keeps its meaning.
Strategy specs: a registered name ("zero2"), "hybrid3d:tp=2,..." or "zero3:activation_checkpointing=full".
With --runs-file, several runs (each a strategy and its cases) share one launch: the process start-up and the
process group are paid once (tests/conftest.py's ``Batch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import DataParallelSyncBatchNorm, Hybrid3DStrategy, MeshStrategy
from lightning_parallel.callbacks.activation import ActivationMemoryMonitor
from lightning_parallel.callbacks.moe import MoEAuxLossScale, MoEMonitor
from lightning_parallel.models import GPTConfig, LitGPT, SyntheticTokens
from lightning_parallel.models.gpt import gpt_tp_plan
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.vgg import VGGConfig
from lightning_parallel.parallel.expert import MoE
from lightning_parallel.parallel.measure.memory import model_state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from byo_model import MLPClassifier, teacher_dataset  # noqa: E402  (the README's bring-your-own-model example)

# tp up to 8 divides it; 2 blocks + embedding + head = 4 pipeline layers (pp up to 4, or 2 x 2 stages)
TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32)
# 8 pipeline layers: enough for pp=8, or pp=4 with 2 stages per rank (the world-8 matrix)
DEEP = GPTConfig(vocab_size=64, seq_len=16, n_layer=6, n_head=8, d_model=32)


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


class RecordingGPT(RecordLosses, LitGPT):
    """LitGPT recording its losses; optionally returns an optimizer we cannot shard."""

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


class MemoryProbe(pl.Callback):
    """Model-state bytes on this rank after the last optimizer step (before the next zero_grad)."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.bytes: dict[str, int] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last_step and self.bytes is None:
            opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
            self.bytes = model_state_bytes(trainer.strategy.model, opts)


class PrecisionProbe(pl.Callback):
    """Per optimizer step: the loss scale (fp16) and a checksum of this rank's parameters (an unchanged checksum
    is a skipped step); optionally makes one rank's gradient overflow at one step."""

    def __init__(self, inject_step: int | None, inject_rank: int) -> None:
        self.inject_step, self.inject_rank = inject_step, inject_rank
        self.scales: list[float | None] = []
        self.param_sums: list[float] = []

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step != self.inject_step or trainer.global_rank != self.inject_rank:
            return
        for p in pl_module.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.view(-1)[0] = float("inf")  # in place: the one element this rank's shard holds
                return

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else None)
        total = 0.0
        for p in trainer.strategy.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.detach().double().abs().sum().item()
        self.param_sums.append(total)


class ShardedData(pl.LightningDataModule):
    """Shuffled batches whose union over the dp ranks is the single-process batch, at any world size.

    Lightning's own sampler does the same split; building it here (from the strategy's dp rank) lets the
    single-process reference use the identical permutation.
    """

    def __init__(self, data, micro_batch: int) -> None:
        super().__init__()
        self.data, self.micro_batch = data, micro_batch

    def _loader(self, shuffle: bool) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {
            "num_replicas": 1,
            "rank": 0,
        }
        sampler = DistributedSampler(self.data, shuffle=shuffle, seed=0, **kwargs)
        return DataLoader(self.data, batch_size=self.micro_batch, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)


def build_strategy(spec: str):
    """'zero2' stays a registered name; 'hybrid3d:tp=2,zero_stage=1,sequence_parallel=1' builds the class from
    ParallelConfig settings, and 'zero3:activation_checkpointing=full' the registered name's class with more."""
    if ":" not in spec:
        return spec
    name, _, items = spec.partition(":")
    kwargs = {}
    for item in items.split(","):
        key, value = item.split("=")
        kwargs[key] = _value(key, value)
    if name != "hybrid3d":
        entry = StrategyRegistry[name]
        return entry["strategy"](**entry["init_params"], **kwargs)
    return Hybrid3DStrategy(**kwargs)


def _value(key: str, value: str):
    if key in ("sequence_parallel", "overlap_grad_reduce", "compile", "offload"):
        return bool(int(value))
    if value.isdigit():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


def batch_ranks(strategy, world: int) -> int:
    """Ranks that see different samples: the mesh's batch role (under Lightning's own strategies, every rank)."""
    return strategy.config.dims(world).role_size("batch") if isinstance(strategy, MeshStrategy) else world


def run_case(case: dict, strategy: str, world: int, out: Path, accelerator: str = "cpu") -> dict:
    pl.seed_everything(case.get("seed", 0), verbose=False)
    steps, accumulate = case.get("steps", 10), case.get("accumulate", 1)
    global_batch = case.get("global_batch", 16)
    strategy_obj = build_strategy(strategy)
    dp = batch_ranks(strategy_obj, world)
    micro = global_batch // (accumulate * dp)
    epoch_steps = case.get("epoch_steps", steps)
    if case.get("model") == "vgg":  # BatchNorm: running statistics are buffers every stage must keep right
        size = case.get("image_size", 32)  # spatial splits need a multiple of 32 x spatial
        data = random_images(global_batch * epoch_steps, size)
        model = RecordingVGG(
            config=VGGConfig(name="vgg11", width=8, image_size=size),
            lr=case.get("lr", 0.01),
            build_in_configure_model=bool(case.get("meta")),
        )
    elif case.get("model") == "moe_classifier":  # not the recipe GPT: a classifier with one MoE layer
        data = token_classes(global_batch * epoch_steps)
        model = RecordingMoEClassifier(lr=case.get("lr", 1e-3), **case.get("moe", {}))
    elif case.get("model") == "byo":
        data = teacher_dataset(global_batch * epoch_steps)
        model = RecordingBYO(lr=case.get("lr", 1e-3))
    else:
        data = SyntheticTokens(num_samples=global_batch * epoch_steps, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
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
    datamodule = ShardedData(data, micro)
    num_params = sum(p.numel() for p in model.parameters())
    probe = MemoryProbe(steps)
    moe_monitor = MoEMonitor()
    callbacks: list[pl.Callback] = [probe, MoEAuxLossScale(), moe_monitor]
    measure = case.get("activation_memory")
    activation_monitor = ActivationMemoryMonitor(batch=measure) if measure is not None else None
    callbacks += [activation_monitor] if activation_monitor else []
    precision, plugins = case.get("precision", "32-true"), []
    precision_probe = None
    if case.get("precision") or case.get("inject_inf") is not None:
        precision_probe = PrecisionProbe(case.get("inject_inf"), case.get("inject_rank", 0))
        callbacks.append(precision_probe)
    if precision == "16-mixed" and strategy == "auto" and accelerator == "cpu":
        # Lightning would run bf16 on CPU: hand it fp16 autocast with torch's own GradScaler (the reference)
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu")]
    if case.get("sync_bn") == "plugin":
        plugins.append(DataParallelSyncBatchNorm())
    logger = False
    if case.get("features"):  # what people use alongside a strategy: checkpoints on a metric, a logger
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpts", monitor="train_loss", every_n_train_steps=2))
        logger = CSVLogger(out, name="logs")
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=world,
        strategy=strategy_obj,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=case.get("clip"),
        precision=precision,
        logger=logger,
        enable_checkpointing=bool(case.get("features")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        log_every_n_steps=1,
        callbacks=callbacks,
        use_distributed_sampler=False,
        sync_batchnorm=case.get("sync_bn") == "trainer",
        plugins=plugins or None,
    )
    result: dict = {"name": case["name"], "num_params": num_params}
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=case.get("resume"))
    except Exception as err:  # noqa: BLE001
        if not case.get("expect_error"):
            raise
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
        return result
    result["losses"] = model.losses
    result["moe"] = moe_monitor.summary(trainer)
    from torch._dynamo.utils import counters  # how many graphs torch.compile made (compile=True)

    result["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    sharding = getattr(trainer.strategy, "_sharding", None)
    result["overlap"] = sharding.overlap_stats() if sharding is not None else {}
    result["built_on"] = getattr(model, "built_on", None)
    result["memory"] = probe.bytes
    result["activation_bytes"] = activation_monitor.bytes if activation_monitor else None
    if precision_probe is not None:
        result["scales"], result["param_sums"] = precision_probe.scales, precision_probe.param_sums
    full_state = getattr(trainer.strategy, "full_state_dict", trainer.strategy.lightning_module_state_dict)
    state = full_state()  # gathered in the single-process format, whatever the checkpoint format
    if trainer.global_rank == 0:
        torch.save(state, out / f"{case['name']}_params.pt")
    if case.get("save"):
        trainer.save_checkpoint(case["save"], weights_only=bool(case.get("weights_only")))
    if case.get("features"):
        result["best_checkpoint"] = callbacks[-1].best_model_path
        result["test_loss"] = trainer.test(model, datamodule=datamodule, verbose=False)[0]["test_loss"]
        predictions = trainer.predict(model, datamodule=datamodule)
        result["predicted_tokens"] = sum(p.numel() for p in predictions)
    if case.get("validate"):
        model.val_samples.reset()
        metrics = trainer.validate(model, datamodule=datamodule, verbose=False)
        result["val_loss"] = metrics[0]["val_loss"]
        result["val_samples"] = int(model.val_samples.compute().item())
    return result


def run_batches(run_case: Callable[[dict, str, int, Path], dict]) -> None:
    """The main of a worker that takes ``--runs-file`` (a JSON ``[{label, strategy, cases}]``, conftest's ``Batch``)
    and ``--out``: every run one after another in this process group, ``run_case(case, strategy, world, out)``'s
    results in ``OUT/<label>/rank<R>.json``, the labels in ``OUT/rank<R>.json``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs-file", required=True, help="JSON [{label, strategy, cases}], each into OUT/<label>/")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    runs = json.loads(Path(args.runs_file).read_text())
    for run in runs:
        run_out = out / run["label"]
        run_out.mkdir(parents=True, exist_ok=True)
        results = [run_case(case, run["strategy"], world, run_out) for case in run["cases"]]
        (run_out / f"rank{rank}.json").write_text(json.dumps(results))
    (out / f"rank{rank}.json").write_text(json.dumps([run["label"] for run in runs]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", help="one run: its strategy spec")
    parser.add_argument("--cases", help="one run: JSON list of cases")
    parser.add_argument(
        "--runs-file",
        help="several runs, one after another in this process group: a JSON file of "
        "[{label, strategy, cases}], each writing into OUT/<label>/",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL: tests/gpu/)")
    args = parser.parse_args()
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if args.runs_file:
        runs = json.loads(Path(args.runs_file).read_text())
    else:
        runs = [{"label": "", "strategy": args.strategy, "cases": json.loads(args.cases)}]
    for run in runs:
        run_out = out / run["label"]
        run_out.mkdir(parents=True, exist_ok=True)
        results = [run_case(case, run["strategy"], world, run_out, args.accelerator) for case in run["cases"]]
        (run_out / f"rank{rank}.json").write_text(json.dumps(results))  # each run's results as soon as it ends
    if args.runs_file:
        (out / f"rank{rank}.json").write_text(json.dumps([run["label"] for run in runs]))


if __name__ == "__main__":
    main()
