"""A callback for the case modules (cases/gpt.py's case key ``trace_step``): strict mode's trace of one training
batch's collectives and point-to-point ops (lightning_parallel/parallel/strict/), as plain rows for the result."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_parallel.parallel import strict


class TraceStep(pl.Callback):
    """Records the operations of batch ``batch`` (from its start to its end) as ``{op, group_size, dtype, bytes}``."""

    def __init__(self, batch: int) -> None:
        self.batch, self.rows = batch, []
        self._recording = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            self._recording = strict.recording()
            self._entries = self._recording.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch and self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
            sizes = {}
            for e in self._entries:
                if e.group not in sizes:
                    sizes[e.group] = len(strict.group_ranks(e.group))
                self.rows.append({"op": e.op, "group_size": sizes[e.group], "dtype": e.dtype, "bytes": e.bytes})
