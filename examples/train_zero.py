"""Train the GPT on generated token data with ZeRO (the README's main job until the recipes exist).

    python examples/train_zero.py                      # zero3 on 2 CPU processes
    python examples/train_zero.py --strategy zero2 --devices 4 --precision bf16-mixed

Lightning starts the extra processes itself (it re-runs this script), so no launcher is needed.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_parallel  # noqa: F401  (registers zero1, zero2, zero3, zero3_offload)
from lightning_parallel.models import GPTConfig, GPTModule, SyntheticTokens
from lightning_parallel.plugins.precision import cpu_fp16_plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", help="zero1, zero2, zero3, zero3_offload, ddp, auto, ...")
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step, all ranks")
    args = parser.parse_args()
    if args.global_batch % args.devices:
        parser.error(f"--global-batch {args.global_batch} must be divisible by --devices {args.devices}")

    pl.seed_everything(0)
    torch.set_num_threads(max(1, torch.get_num_threads() // args.devices))
    config = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128)
    model = GPTModule(config, lr=3e-3)
    train = SyntheticTokens(num_samples=4096, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    val = SyntheticTokens(num_samples=256, seq_len=config.seq_len, vocab_size=config.vocab_size, split=1)
    per_rank = args.global_batch // args.devices
    # 16-mixed on CPU: Lightning would run bf16; torch's CPU autocast runs fp16, asked for with the plugin
    fp16 = cpu_fp16_plugin(args.precision, args.accelerator) if args.strategy.startswith("zero") else None
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=None if fp16 else args.precision,
        plugins=[fp16] if fp16 else None,
        max_steps=args.steps,
        val_check_interval=50,
        limit_val_batches=4,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=pl.loggers.CSVLogger("runs", name="train_zero"),
        enable_checkpointing=False,
    )
    trainer.fit(
        model,
        train_dataloaders=DataLoader(train, batch_size=per_rank, shuffle=True),
        val_dataloaders=DataLoader(val, batch_size=per_rank),
    )
    if trainer.is_global_zero:
        metrics = {k: round(v.item(), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {args.strategy} on {trainer.world_size} processes, {trainer.global_step} steps, {metrics}")
        print(f"(a uniform guess scores {torch.log(torch.tensor(config.vocab_size)).item():.4f})")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
