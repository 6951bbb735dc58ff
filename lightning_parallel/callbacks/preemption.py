"""Stop on SIGTERM (a scheduler's notice before preemption): every rank stops after the same step, the
newest state is saved as the ``last`` checkpoint, and the run ends cleanly; ``ckpt_path="last"`` resumes it.

Lightning 2.6.6 handles SIGTERM itself, in ways that do not hold across ranks: its handler broadcasts from
rank 0 inside the signal handler (a collective that the other ranks do not issue at that moment), and the
loop stops on each rank's own flag, so a signal that reaches some ranks only stops some ranks. This
callback replaces that handler while training runs with one that only sets a flag, and reduces the flag
over the world once per step (one all-reduce of one number), so every rank sees a signal that reached any
of them after the same step.

No host sync in the step: the flag is a host tensor reduced over gloo (the world group when it is gloo, else a
gloo group of the same ranks made at the fit's start), without waiting: a step's end reads the reduction the
previous step's end started (long done by then), so a signal during step k stops every rank after step k + 1.

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
import numpy as np
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
        self._group: Any = None  # the group the flag is reduced over (None: the world's, gloo)
        self._pending: tuple[Any, np.ndarray] | None = None  # the reduction started at the last step's end

    def _on_signal(self, signum: int, frame: Any) -> None:
        # only a flag: a collective here would interleave with the one this rank may be in
        self.received = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning registered its own handler (Trainer._run), which this one replaces while training runs
        self.received = False
        self._pending = None
        if _distributed() and self._group is None and "gloo" not in str(dist.get_backend()):
            self._group = dist.new_group(backend="gloo")  # every rank, at the same point: a host-side twin
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:  # the last step's reduction: done before the groups may go
            self._pending[0].wait()
            self._pending = None
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pending = None  # our stop started none; after a failure the group may be broken: not waited for
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
        """Whether any rank had the signal by the previous step's end (collective: every rank calls it after every
        step). The flag is a host array shared with a CPU tensor: gloo reduces it in place, and reading the array
        is no tensor read, so nothing here waits for a device."""
        if not _distributed():
            return self.received
        if self._pending is not None:
            work, seen = self._pending
            self._pending = None
            work.wait()  # host-side: gloo finished it during the step that just ran
            if seen[0]:
                return True
        flag = np.array([int(self.received)], dtype=np.int32)
        work = dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return False

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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _same_folder(a: storage.Location, b: storage.Location) -> bool:
    if storage.has_scheme(a) or storage.has_scheme(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return Path(a).resolve() == Path(b).resolve()
