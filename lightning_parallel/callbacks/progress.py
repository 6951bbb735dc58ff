"""The recipes' progress bar: the optimizer step out of ``max_steps`` and the loss first, no logger version.

Lightning's bars count the batches of the current epoch and title the bar ``Epoch {e}/{max_epochs - 1}``, which
reads ``Epoch 0/-2`` for a run bounded by ``max_steps`` (``max_epochs=-1``: no bound on epochs). A recipe's run is
bounded by steps, so these bars show ``step 3/10`` and ``train_loss`` first, drop ``v_num`` (the logger's version,
not a metric) and title an unbounded run ``Epoch 0``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

FIRST = ("step", "train_loss")  # shown first, in this order


def step_metrics(trainer: pl.Trainer, metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` (a bar's) with ``step`` (``global_step/max_steps``, or the step alone without a bound) and
    ``train_loss`` first, and no ``v_num``."""
    step: Any = f"{trainer.global_step}/{trainer.max_steps}" if trainer.max_steps > 0 else trainer.global_step
    rest = {name: value for name, value in metrics.items() if name != "v_num"}
    rest["step"] = step
    return {name: rest[name] for name in FIRST if name in rest} | {k: v for k, v in rest.items() if k not in FIRST}


def epoch_title(trainer: pl.Trainer) -> str:
    """``Epoch e/last`` when epochs bound the run, ``Epoch e`` when they do not (``max_epochs`` None or -1)."""
    last = trainer.max_epochs
    return f"Epoch {trainer.current_epoch}" + (f"/{last - 1}" if last is not None and last > 0 else "")


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich bar with :func:`step_metrics` and :func:`epoch_title`."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return step_metrics(trainer, super().get_metrics(trainer, pl_module))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=epoch_title(trainer))


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with :func:`step_metrics` (its title is ``Epoch e`` already)."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return step_metrics(trainer, super().get_metrics(trainer, pl_module))


def step_progress_bar() -> RichProgressBar | TQDMProgressBar:
    """The bar Lightning would pick (rich when installed, else tqdm), showing steps and the loss."""
    return StepRichProgressBar() if importlib.util.find_spec("rich") else StepTQDMProgressBar()
