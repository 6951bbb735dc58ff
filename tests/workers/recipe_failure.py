"""Driver: the GPT recipe, launched by the recipe's own launcher (torch elastic), with one rank failing.

    python recipe_failure.py RUN_DIR raise|kill RANK STEP [override ...]

Composes ``conf/train_gpt.yaml`` with the overrides, as ``recipes/train_gpt.py`` does, and runs it through
``lightning_parallel.recipes.launch.run``; in the workers, the recipe's Trainer gets one more callback that
makes rank RANK raise (or SIGKILL itself) at training step STEP. Prints ``PID <rank> <pid>`` per worker.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write: lines of several ranks sharing a pipe stay whole


class FailAt(pl.Callback):
    def __init__(self, how: str, rank: int, step: int) -> None:
        self.how, self.rank, self.step = how, rank, step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        say(f"PID {trainer.global_rank} {os.getpid()}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            say(f"FAILING {time.time()}")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"injected failure at step {self.step}")


def train(cfg: Any, run_dir: Path) -> Any:
    """The recipe's ``train`` with :class:`FailAt` added to its Trainer (in each worker)."""
    import lightning_parallel.recipes.gpt as gpt

    build = gpt.build_trainer
    how, rank, step = os.environ["FAIL_HOW"], int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])
    gpt.build_trainer = lambda cfg, run_dir, **kw: build(cfg, run_dir, callbacks=[FailAt(how, rank, step)], **kw)
    return gpt.train(cfg, run_dir)


def main() -> None:
    run_dir, how, rank, step, *overrides = sys.argv[1:]
    os.environ.update(FAIL_HOW=how, FAIL_RANK=rank, FAIL_STEP=step)  # the spawned workers inherit them
    import lightning_parallel  # noqa: F401
    from lightning_parallel.recipes.config import register_configs
    from lightning_parallel.recipes.launch import run

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_gpt", overrides=overrides)
    run(cfg, Path(run_dir), entry="recipe_failure.train")


if __name__ == "__main__":
    main()
