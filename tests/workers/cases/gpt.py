"""Case ``gpt``: trains the tiny GPT (or another model of cases/models.py) under the run's strategy; rank 0 saves
the gathered parameters as <name>_params.pt. The single-process reference is the same case at world 1 under "auto".

Case keys: name, steps, global_batch, accumulate, clip, precision, seed, save (checkpoint path after
fit; weights_only: without optimizer states), resume (ckpt_path for fit), memory (measure model-state bytes
after the last step), validate, optimizer ("adamw", "lbfgs", "sgd", "muon": MuonAdamW with an fp32 Newton-Schulz,
"muon_bf16": with torch's bf16 one), expect_error (record the exception instead of failing), model ("gpt",
"top_level", "byo": the README's bring-your-own-model example, or "vgg": BatchNorm), meta (build the GPT or VGG
in configure_model), deep (6 blocks instead of 2), sync_bn ("trainer": Trainer(sync_batchnorm=True), "plugin":
Trainer(plugins=[DataParallelSyncBatchNorm()])), inject_inf (the global step whose gradient gets an inf on rank
inject_rank, default 0, in one element of its first parameter's local gradient: an fp16 overflow seen by one
rank); with a precision set, the loss scale and a checksum of this rank's parameters are recorded per step.

Also: flip_batch (each batch's samples reversed: the same math in another summation order, a noise floor),
emulate_precision_casts (inductor's setting of that name on for the rest of the launch, compiled graphs and their count
reset: compiled layers round to bf16 where eager does),
image_size (VGG: the random images' height and width, default 32), activation_memory (the training batch
whose activation bytes ActivationMemoryMonitor records, 0: first), trace_step (the training batch whose collectives
strict mode's trace records: the result's ``trace``, rows of op, group_size, dtype, bytes; cases/trace_step.py).
--accelerator (default cpu): "gpu" under tests/gpu/ (NCCL, one device per rank); every case keeps its meaning.
Strategy specs: cases/common.py's ``build_strategy``.
"""

from __future__ import annotations

import traceback

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_parallel import DataParallelSyncBatchNorm
from lightning_parallel.callbacks.activation import ActivationMemoryMonitor
from lightning_parallel.callbacks.moe import MoEAuxLossScale, MoEMonitor
from lightning_parallel.parallel.measure.memory import model_state_bytes

from .common import ShardedData, batch_ranks, build_strategy, make_trainer
from .models import build_model
from .trace_step import TraceStep


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


def run_case(case: dict, ctx) -> dict:
    strategy, world, out, accelerator = ctx.strategy, ctx.world, ctx.out, ctx.accelerator
    pl.seed_everything(case.get("seed", 0), verbose=False)
    steps, accumulate = case.get("steps", 10), case.get("accumulate", 1)
    global_batch = case.get("global_batch", 16)
    strategy_obj = build_strategy(strategy)
    dp = batch_ranks(strategy_obj, world)
    micro = global_batch // (accumulate * dp)
    epoch_steps = case.get("epoch_steps", steps)
    model, data = build_model(case, global_batch * epoch_steps)
    datamodule = ShardedData(data, micro, flip=bool(case.get("flip_batch")))
    num_params = sum(p.numel() for p in model.parameters())
    probe = MemoryProbe(steps)
    moe_monitor = MoEMonitor()
    callbacks: list[pl.Callback] = [probe, MoEAuxLossScale(), moe_monitor]
    measure = case.get("activation_memory")
    activation_monitor = ActivationMemoryMonitor(batch=measure) if measure is not None else None
    callbacks += [activation_monitor] if activation_monitor else []
    tracer = TraceStep(case["trace_step"]) if case.get("trace_step") is not None else None
    callbacks += [tracer] if tracer else []
    precision, plugins = case.get("precision", "32-true"), []
    precision_probe = None
    if case.get("precision") or case.get("inject_inf") is not None:
        precision_probe = PrecisionProbe(case.get("inject_inf"), case.get("inject_rank", 0))
        callbacks.append(precision_probe)
    if precision == "16-mixed" and accelerator == "cpu":
        # Lightning would run bf16 on CPU: hand it fp16 autocast, asked for explicitly (the reference keeps torch's
        # own GradScaler; a mesh strategy turns the plugin into its own, with its loss scaler)
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu")]
    if precision == "fp8":  # torchao float8 over bf16-mixed (tests/test_fp8*.py); case key fp8: the plugin's settings
        from lightning_parallel.plugins.float8 import Float8Precision

        device = accelerator if accelerator == "cpu" else None
        precision, plugins = None, [Float8Precision(device=device, **case.get("fp8", {}))]
    if case.get(
        "emulate_precision_casts"
    ):  # inductor keeps eager's low-precision roundings (tests/test_fp8_compile.py)
        import torch._inductor.config
        from torch._dynamo.utils import counters

        torch._inductor.config.emulate_precision_casts = True
        torch._dynamo.reset()  # no graph compiled before the setting is reused; compiled_graphs counts this run's
        counters.clear()
    if case.get("sync_bn") == "plugin":
        plugins.append(DataParallelSyncBatchNorm())
    logger = False
    if case.get("features"):  # what people use alongside a strategy: checkpoints on a metric, a logger
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpts", monitor="train_loss", every_n_train_steps=2))
        logger = CSVLogger(out, name="logs")
    trainer = make_trainer(
        world,
        strategy_obj,
        accelerator=accelerator,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=case.get("clip"),
        precision=precision,
        logger=logger,
        enable_checkpointing=bool(case.get("features")),
        limit_val_batches=2,
        log_every_n_steps=1,
        callbacks=callbacks,
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
    result.update({"trace": tracer.rows} if tracer else {})
    return {**result, **_after_fit(case, trainer, model, datamodule, out)}


def _after_fit(case: dict, trainer: pl.Trainer, model: pl.LightningModule, datamodule, out) -> dict:
    """What the fit recorded, the gathered parameters (rank 0 saves them) and the case's steps after the fit."""
    found = {type(c): c for c in trainer.callbacks}
    probe, precision_probe = found[MemoryProbe], found.get(PrecisionProbe)
    activation_monitor = found.get(ActivationMemoryMonitor)
    result: dict = {"losses": model.losses, "moe": found[MoEMonitor].summary(trainer)}
    from torch._dynamo.utils import counters  # how many graphs torch.compile made (compile=True)

    result["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    sharding = getattr(getattr(trainer.strategy, "runtime", None), "sharding", None)
    result["overlap"] = sharding.overlap_stats() if sharding is not None else {}
    result["built_on"] = getattr(model, "built_on", None)
    result["memory"] = probe.bytes
    optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0]) if trainer.optimizers else None
    result["muon_exchange"] = dict(getattr(optimizer, "exchange", {}))  # MuonAdamW: the last step's exchange
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
        result["best_checkpoint"] = trainer.checkpoint_callback.best_model_path
        result["test_loss"] = trainer.test(model, datamodule=datamodule, verbose=False)[0]["test_loss"]
        predictions = trainer.predict(model, datamodule=datamodule)
        result["predicted_tokens"] = sum(p.numel() for p in predictions)
    if case.get("validate"):
        model.val_samples.reset()
        metrics = trainer.validate(model, datamodule=datamodule, verbose=False)
        result["val_loss"] = metrics[0]["val_loss"]
        result["val_samples"] = int(model.val_samples.compute().item())
    return result
