"""Stop on SIGTERM (a scheduler's notice before preemption): every rank stops after the same step, the
newest state is saved as the ``last`` checkpoint, and the run ends cleanly; ``ckpt_path="last"`` resumes it.

Lightning 2.6.6 handles SIGTERM itself, in ways that do not hold across ranks: its handler broadcasts from
rank 0 inside the signal handler (a collective that the other ranks do not issue at that moment), and the
loop stops on each rank's own flag, so a signal that reaches some ranks only stops some ranks. This
callback replaces that handler while training runs with one that only sets a flag, and reduces the flag
over the world once per step (one all-reduce of one number), so every rank sees a signal that reached any
of them after the same step.

Usage::

    trainer = pl.Trainer(..., callbacks=[Preemption(dirpath="checkpoints")])
    trainer.fit(model, ckpt_path="last")   # a restart continues from the checkpoint the signal saved
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_parallel.parallel.checkpoint import storage

PREEMPTED_FILE = "preempted.json"


class Preemption(pl.Callback):
    """On SIGTERM, save ``dirpath/last.ckpt`` after a step every rank agrees on, then end the fit.

    The fit ends by raising Lightning's ``SIGTERMException`` (a ``SystemExit`` with code 0) on every rank:
    a script that does not catch it exits with status 0. With ``marker`` set, rank 0 also writes there what
    was saved (step, path), for a launcher to report.

    Args:
        dirpath: folder of the ``last`` checkpoint (the ``ModelCheckpoint`` folder, so that
            ``ckpt_path="last"`` finds it); ``None``: stop without saving.
        marker: a JSON file rank 0 writes after the save (``None``: none).
        signals: the signals that ask for a stop.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        marker: str | Path | None = None,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
    ) -> None:
        self.dirpath = None if dirpath is None else storage.local(str(dirpath))  # a folder or a URL
        self.marker = None if marker is None else Path(marker)
        self.signals = signals
        self.received = False
        self._previous: dict[signal.Signals, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # only a flag: a collective here would interleave with the one this rank may be in
        self.received = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning registered its own handler (Trainer._run), which this one replaces while training runs
        self.received = False
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SystemExit):  # our own stop: Lightning's handler back until its teardown
            self._restore()
            return
        # a failure: keep only noting SIGTERM (which a launcher sends once a rank has failed) until Lightning's
        # teardown puts the handlers from before the fit back; Lightning's own would broadcast over a process
        # group that just broke, while the strategy reports the error
        self._previous = {}

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._anyone_received(trainer):
            return
        path = self._save(trainer)
        saved = f"saved {path}" if path else "nothing saved (no checkpoint folder)"
        rank_zero_info(f"Preempted (SIGTERM): stopped after step {trainer.global_step} on every rank, {saved}.")
        if self.marker is not None and trainer.is_global_zero:
            record = {"step": trainer.global_step, "checkpoint": None if path is None else str(path)}
            self.marker.write_text(json.dumps({**record, "time": time.time()}))
        raise SIGTERMException(0)

    def _anyone_received(self, trainer: pl.Trainer) -> bool:
        """Whether any rank got the signal (collective: every rank calls it after every step)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)], device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _save(self, trainer: pl.Trainer) -> storage.Location | None:
        """``dirpath/last.ckpt`` through the strategy (collective); the ModelCheckpoint of that folder is
        told that this is its newest ``last``, so after a resume it overwrites it instead of adding ``last-v1``."""
        if self.dirpath is None:
            return None
        path = storage.join(self.dirpath, f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}")
        for callback in trainer.checkpoint_callbacks:
            mine = callback.dirpath and _same_folder(callback.dirpath, self.dirpath)
            if isinstance(callback, ModelCheckpoint) and mine:
                callback.last_model_path = str(path)
        trainer.save_checkpoint(path)
        return path


def _same_folder(a: storage.Location, b: storage.Location) -> bool:
    if storage.has_scheme(a) or storage.has_scheme(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return Path(a).resolve() == Path(b).resolve()
