"""Case ``rank_failure``: one rank fails or gets a SIGTERM at a given step (tests/test_rank_failure.py,
tests/test_preemption.py), in a plain Trainer script or in the GPT recipe.

Run as a user runs a script: ``python run.py rank_failure --opts JSON --out DIR`` (Lightning's launcher re-runs that
command line for the other ranks) or under ``torchrun``. Case keys: fail (raise, kill, sigterm, stop: SIGSTOP, or lag:
a sleep, tests/test_heartbeat.py), rank, step, and for the plain Trainer (hybrid3d on the README's
bring-your-own-model example) devices, nodes, tp, timeout (the strategy's, seconds), pace (seconds of sleep per step);
or recipe (``[RUN_DIR, override, ...]``): ``conf/train_gpt.yaml`` composed with the overrides and run through the
recipe's own launcher (``lightning_parallel.recipes.launch.run``, torch elastic), whose workers add :class:`FailAt` to
the recipe's Trainer (:func:`train`; fail: raise or kill).

Every rank prints ``PID <rank> <pid>`` when training starts and, at the failure, ``FAILING <unix time>``. With
fail=sigterm the rank sends SIGTERM to itself (a signal that reaches one rank only) and every rank of the plain
Trainer writes ``OUT/rank<N>.json`` with the step it stopped at (the fit ends in a SystemExit(0): run.py writes
nothing over it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.callbacks.preemption import Preemption

from .models import MLPClassifier, teacher_dataset

ROOT = Path(__file__).resolve().parents[3]


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write: lines of several ranks sharing a pipe stay whole


class FailAt(pl.Callback):
    """Makes rank ``rank`` fail at training batch ``step`` (before its collectives: the others wait in them)."""

    def __init__(self, how: str, rank: int, step: int, pace: float = 0.0) -> None:
        self.how, self.rank, self.step, self.pace = how, rank, step, pace

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        say(f"PID {trainer.global_rank} {os.getpid()}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        time.sleep(self.pace)  # seconds per step: training long enough for the watch to beat a few times
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        say(f"FAILING {time.time()}")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "stop":  # frozen, not dead: only the others' heartbeat watch can tell
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if self.how == "lag":  # alive and beating, but never reaching the step's collectives
            time.sleep(3600)
            return
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise ValueError(f"injected failure at step {self.step}")


class RecordStop(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        record = {"step": trainer.global_step, "exception": type(exception).__name__}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def train(cfg: Any, run_dir: Path) -> Any:
    """The recipe's ``train`` with :class:`FailAt` added to its Trainer (in each worker of the recipe's launcher)."""
    import lightning_parallel.recipes.gpt as gpt

    build = gpt.build_trainer
    how, rank, step = os.environ["FAIL_HOW"], int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])
    gpt.build_trainer = lambda cfg, run_dir, **kw: build(cfg, run_dir, callbacks=[FailAt(how, rank, step)], **kw)
    return gpt.train(cfg, run_dir)


def run_recipe(case: dict) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_parallel.recipes.config import register_configs
    from lightning_parallel.recipes.launch import run

    run_dir, *overrides = case["recipe"]
    fail = {"FAIL_HOW": case["fail"], "FAIL_RANK": str(case["rank"]), "FAIL_STEP": str(case["step"])}
    os.environ.update(fail)  # the spawned workers inherit them
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_gpt", overrides=overrides)
    run(cfg, Path(run_dir), entry=f"{__name__}.train")


def run_case(case: dict, ctx) -> dict:
    if "recipe" in case:
        run_recipe(case)
        return {}
    pl.seed_everything(0, verbose=False)
    ckpt_dir = ctx.out / "checkpoints"
    fail = FailAt(case["fail"], case.get("rank", 1), case.get("step", 3), case.get("pace", 0.0))
    callbacks = [fail, RecordStop(ctx.out)]
    callbacks += [Preemption(ckpt_dir), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=100, save_last=True)]
    trainer = pl.Trainer(
        strategy=Hybrid3DStrategy(tp=case.get("tp", 1), timeout=case.get("timeout", 30)),
        devices=case.get("devices", 2),
        num_nodes=case.get("nodes", 1),
        accelerator="cpu",
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(MLPClassifier(depth=2), DataLoader(teacher_dataset(4096), batch_size=8))
    return {"step": trainer.global_step}
