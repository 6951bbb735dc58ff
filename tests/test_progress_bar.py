"""The recipes' progress bar: the step out of max_steps and the loss first, no v_num, no "Epoch 0/-2"."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_parallel.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar, epoch_title


class LogsLoss(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], prog_bar=True)
        self.log("other", torch.tensor(1.0), prog_bar=True)
        return out


@pytest.mark.parametrize("bar_type", [StepTQDMProgressBar, StepRichProgressBar])
def test_the_bar_shows_steps_and_loss(tmp_path, bar_type):
    bar = bar_type()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=3, limit_val_batches=0, callbacks=[bar], enable_model_summary=False
    )
    model = LogsLoss()
    trainer.fit(model)
    shown = bar.get_metrics(trainer, model)
    assert list(shown)[:3] == ["step", "train_loss", "other"] and shown["step"] == "3/3"
    assert "v_num" not in shown
    assert trainer.max_epochs == -1 and epoch_title(trainer) == f"Epoch {trainer.current_epoch}"  # not ".../-2"
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=3)
    assert epoch_title(trainer) == "Epoch 0/2"
