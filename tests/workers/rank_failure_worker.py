"""Worker: a plain Trainer script (hybrid3d) in which one rank fails or gets a SIGTERM at a given step.

Run as a user would: ``python rank_failure_worker.py --devices 2`` (Lightning's launcher re-runs it for the
other ranks) or under ``torchrun``. Every rank prints ``PID <rank> <pid>`` when training starts and, at
the failure, ``FAILING <unix time>``. With ``--fail sigterm`` the rank sends SIGTERM to itself (a signal
that reaches one rank only) and every rank writes ``rank<N>.json`` with the step it stopped at.

    --fail raise|kill|sigterm  --rank R  --step S  --devices N  --tp T  --timeout SECONDS  --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.callbacks.preemption import Preemption

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from byo_model import MLPClassifier, teacher_dataset  # noqa: E402


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write: lines of several ranks sharing a pipe stay whole


class FailAt(pl.Callback):
    """Makes rank ``rank`` fail at training batch ``step`` (before its collectives: the others wait in them)."""

    def __init__(self, how: str, rank: int, step: int) -> None:
        self.how, self.rank, self.step = how, rank, step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        say(f"PID {trainer.global_rank} {os.getpid()}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        say(f"FAILING {time.time()}")
        if self.how == "raise":
            raise ValueError(f"injected failure at step {self.step}")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)


class RecordStop(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        record = {"step": trainer.global_step, "exception": type(exception).__name__}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail", choices=["raise", "kill", "sigterm"], required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    pl.seed_everything(0, verbose=False)
    ckpt_dir = a.out / "checkpoints"
    callbacks = [FailAt(a.fail, a.rank, a.step), RecordStop(a.out), Preemption(ckpt_dir)]
    callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=100, save_last=True))
    trainer = pl.Trainer(
        strategy=Hybrid3DStrategy(tp=a.tp, timeout=a.timeout),
        devices=a.devices,
        accelerator="cpu",
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(MLPClassifier(depth=2), DataLoader(teacher_dataset(4096), batch_size=8))


if __name__ == "__main__":
    main()
