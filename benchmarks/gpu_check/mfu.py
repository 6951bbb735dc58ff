"""Section 4: tokens/s and MFU of one model, batch and precision three ways, each in its own process.

- ``plain``: a plain PyTorch loop: ``torch.compile`` of the whole GPT, bf16 autocast, fused AdamW.
- ``lightning``: Lightning's single-device run (``strategy="auto"``, ``precision="bf16-mixed"``), the layers
  compiled as ``strategy.compile=True`` compiles them, fused AdamW.
- ``ours``: ``Hybrid3DStrategy(zero_stage=1, compile=True)`` at world 1 (dp=1: ZeRO-1's flat buffers over a group
  of one), fused AdamW.

MFU = FLOPs of a step (the repository's counter, :func:`workload.flops_per_step`) x steps/s / the device's dense
bf16 peak (:data:`lightning_parallel.parallel.measure.flops.PEAK_FLOPS`), as the TrainingMonitor computes it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_parallel.models import GPTModule
from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.parallel.measure.flops import peak_flops

from .section import log
from .workload import Clock, Workload, flops_per_step


class FusedAdamGPT(GPTModule):
    """LitGPT with the plain loop's optimizer: AdamW, fused, the same two parameter groups."""

    def configure_optimizers(self) -> Any:
        return adamw(self.parameters(), self.lr, self.weight_decay)


def adamw(params: Any, lr: float = 6e-4, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def run_plain(config: dict[str, Any]) -> dict[str, Any]:
    work = Workload.from_config(config)
    torch.manual_seed(0)
    model = RecipeGPT(work.gpt_config).to(work.device)
    step_model = torch.compile(model) if work.compile else model
    optimizer = adamw(model.parameters())
    idx, targets = (t.pin_memory() if work.device == "cuda" else t for t in work.batch())
    dtype = torch.bfloat16 if work.precision.startswith("bf16") else torch.float32
    clock, losses = Clock(work.device), []
    _reset_peak(work)
    began = time.perf_counter()
    for step in range(work.warmup + work.steps):
        if step == work.warmup:
            clock.start()
            clock.warmup_seconds = clock.began - began
        x, y = idx.to(work.device, non_blocking=True), targets.to(work.device, non_blocking=True)
        with torch.autocast(work.device, dtype=dtype, enabled=dtype != torch.float32):
            logits = step_model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # LitGPT.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step < work.warmup:
            log(f"plain: warm-up step {step + 1}/{work.warmup} done")
    clock.stop()
    return _measurement(work, clock, [float(v) for v in losses], "plain PyTorch loop")


class StepClock(pl.Callback):
    """Starts the clock at the first timed step's start and stops it at the last step's end."""

    def __init__(self, work: Workload) -> None:
        self.work, self.clock, self.losses = work, Clock(work.device), []
        self.began = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.began = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.work.warmup:
            self.clock.start()
            self.clock.warmup_seconds = self.clock.began - self.began

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach() if isinstance(outputs, dict) else outputs.detach())
        if len(self.losses) <= self.work.warmup:
            log(f"{type(trainer.strategy).__name__}: warm-up step {len(self.losses)}/{self.work.warmup} done")
        if len(self.losses) == self.work.warmup + self.work.steps:
            self.clock.stop()


def run_lightning(config: dict[str, Any]) -> dict[str, Any]:
    from lightning_parallel.parallel.parallelize import compile_layers

    work = Workload.from_config(config)
    return _fit(work, "auto", compile_layers if work.compile else None, "Lightning, strategy='auto'")


def run_ours(config: dict[str, Any]) -> dict[str, Any]:
    from lightning_parallel import Hybrid3DStrategy

    work = Workload.from_config(config)
    _torchrun_env()
    strategy = Hybrid3DStrategy(zero_stage=1, compile=work.compile)
    return _fit(work, strategy, None, "ours: hybrid3d zero_stage=1, world 1")


def _fit(work: Workload, strategy: Any, compile_fn: Any, label: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = FusedAdamGPT(work.gpt_config, lr=6e-4)
    if compile_fn is not None:
        compile_fn(model)
    idx, targets = work.batch()
    repeats = work.warmup + work.steps
    data = torch.utils.data.TensorDataset(idx.repeat(repeats, 1), targets.repeat(repeats, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=work.micro_batch, pin_memory=work.device == "cuda")
    timer = StepClock(work)
    trainer = pl.Trainer(
        accelerator="gpu" if work.device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision=work.precision,
        max_steps=work.warmup + work.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
        use_distributed_sampler=False,  # the same batch every step, in order, whatever the strategy
    )
    _reset_peak(work)
    trainer.fit(model, train_dataloaders=loader)
    return _measurement(work, timer.clock, [float(v) for v in timer.losses], label)


def _measurement(work: Workload, clock: Clock, losses: list[float], label: str) -> dict[str, Any]:
    seconds, flops = clock.seconds, flops_per_step(work)
    steps_per_second = work.steps / seconds if seconds > 0 else None
    peak = peak_flops(torch.cuda.get_device_name(0), "bf16") if work.device == "cuda" else None
    mfu = flops["counted"] * steps_per_second / peak if peak and steps_per_second else None
    return {
        "variant": label,
        "model": work.model,
        "micro_batch": work.micro_batch,
        "precision": work.precision,
        "compiled": work.compile,
        "timed_steps": work.steps,
        "warmup_seconds": clock.warmup_seconds,
        "step_seconds": seconds / work.steps if seconds > 0 else None,
        "tokens_per_second": work.tokens_per_step * steps_per_second if steps_per_second else None,
        "flops_per_step": flops,
        "peak_flops": peak,
        "mfu": mfu,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if work.device == "cuda" else None,
        "losses": losses,
    }


def _reset_peak(work: Workload) -> None:
    if work.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _torchrun_env() -> None:
    """A world of one as torchrun would describe it (our strategy initializes a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    env |= {"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "gpu-check"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
