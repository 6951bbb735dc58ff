"""A user's own training script, as plain as they come: an ordinary LightningModule (the README's
bring-your-own-model example), one of our strategies, ``trainer.fit`` (then optionally ``trainer.test``), and
the end of the script. Nothing here ends the process early: it exits the way Python exits, so its exit status
is what a user's job would report.

Kept a script, not a case of run.py: its exit status is the claim under test, and it must be that of a plain user
script (``python script.py`` / ``torchrun script.py``), with no harness of ours between ``fit`` and the exit.

    torchrun --standalone --nproc-per-node 2 exit_worker.py --strategy zero2 [--test] [--raise-at STEP]
    python exit_worker.py --strategy zero3 --devices 2        # Lightning's own launcher

``--strategy`` is ``zero2``, ``zero3`` or ``hybrid3d-pp2`` / ``hybrid3d-tp2`` / ``hybrid3d-pp2-tp2``. With
``--raise-at`` rank 0 raises in its training step at that step (a bug in user code). ``--preempt-dir`` saves
``last.ckpt`` there when a SIGTERM arrives (lightning_parallel.Preemption); ``--resume`` continues from it;
``--sleep-per-step`` slows each step so a signal can arrive mid-run. Rank 0 prints ``DONE <losses>`` when fit
returned.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_parallel import Hybrid3DStrategy, Preemption, ZeroStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from byo_model import MLPClassifier, teacher_dataset  # noqa: E402

STRATEGIES = {
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3": lambda: ZeroStrategy(stage=3),
    "hybrid3d-pp2": lambda: Hybrid3DStrategy(pp=2),
    "hybrid3d-tp2": lambda: Hybrid3DStrategy(tp=2),
    "hybrid3d-pp2-tp2": lambda: Hybrid3DStrategy(pp=2, tp=2),
}


class Model(MLPClassifier):
    def __init__(self, raise_at: int | None, sleep_per_step: float) -> None:
        super().__init__(depth=2)
        self.raise_at, self.sleep_per_step = raise_at, sleep_per_step
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.raise_at is not None and self.global_step == self.raise_at and self.global_rank == 0:
            raise ValueError(f"a bug in the user's training step at step {self.global_step}")
        time.sleep(self.sleep_per_step)
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=sorted(STRATEGIES), required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--test", action="store_true", help="trainer.test after trainer.fit")
    p.add_argument("--raise-at", type=int)
    p.add_argument("--preempt-dir", type=Path)
    p.add_argument("--resume", action="store_true", help="ckpt_path=last in --preempt-dir")
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = []
    if args.preempt_dir is not None:
        callbacks += [Preemption(args.preempt_dir), ModelCheckpoint(dirpath=args.preempt_dir, save_last=True)]
    trainer = pl.Trainer(
        strategy=STRATEGIES[args.strategy](),
        devices=args.devices,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.preempt_dir is not None,
        callbacks=callbacks,
        limit_test_batches=2,
    )
    model = Model(args.raise_at, args.sleep_per_step)
    data = DataLoader(teacher_dataset(512), batch_size=16)
    ckpt = "last" if args.resume else None
    trainer.fit(model, data, ckpt_path=str(args.preempt_dir / "last.ckpt") if ckpt else None)
    if args.test:
        trainer.test(model, data, verbose=False)
    params = {k: v.detach().double().sum().item() for k, v in trainer.strategy.full_state_dict().items()}
    if trainer.global_rank == 0:
        print("DONE " + json.dumps({"losses": model.losses, "step": trainer.global_step, "params": params}))


if __name__ == "__main__":
    main()
