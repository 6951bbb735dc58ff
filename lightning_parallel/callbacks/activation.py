"""Activation checkpointing as a callback, for Lightning's own strategies ("auto", "ddp"; the mesh strategies
take ``activation_checkpointing=`` themselves), and a callback that measures activation memory on any device."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    check_activation_checkpointing,
    checkpoint_layers,
)
from lightning_parallel.parallel.measure.memory import ActivationMemory


class ActivationCheckpointing(pl.Callback):
    """Recompute each layer's activations in backward under any strategy (for ``zero*`` and ``hybrid3d`` use
    their ``activation_checkpointing`` argument instead: they apply it in the right order with their sharding).

    Applied when the fit starts, once the model exists (also when built in ``configure_model``); the layers are
    the module's ``pipeline_layers()`` if it has them, else its repeated blocks.

    Args:
        mode: ``"none"``, ``"full"`` or ``"selective"``.
    """

    def __init__(self, mode: str) -> None:
        self.mode = check_activation_checkpointing(mode, "mode")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode != "none" and not apply_activation_checkpointing(pl_module, self.mode):
            raise ValueError(
                f"ActivationCheckpointing({self.mode!r}) found no layers in {type(pl_module).__name__}: give it "
                "pipeline_layers() or keep its repeated blocks in an nn.ModuleList."
            )


class ActivationMemoryMonitor(pl.Callback):
    """Bytes of activations this rank holds for backward during one training batch, logged as ``activation_bytes``.

    Counted from the tensors themselves (:class:`~lightning_parallel.parallel.measure.memory.ActivationMemory`), so the
    number is the same on CPU and GPU and shows what ``activation_checkpointing`` saves: what the batch's
    forward (loss included) leaves alive for backward. Under pipeline parallelism the schedule runs forward
    and backward of several microbatches inside the step; there it is the peak over the ends of this rank's
    layers during the schedule (the microbatches in flight, the last stage's loss tensors not included, and
    whatever communication buffers are in flight at those moments, such as ZeRO-3's gathered parameters).

    Args:
        batch: which training batch of the fit to measure. The default, 2 (the third), leaves out the one-off
            work of the first two (pipeline shape inference; Lightning's ddp rebuilds its gradient buckets in the
            second forward); a fit that ends sooner reports its last batch.

    Attributes:
        bytes: this rank's measurement once taken, else None.
    """

    def __init__(self, batch: int = 2) -> None:
        self.batch = batch
        self.bytes: int | None = None
        self._seen = 0
        self._meter: ActivationMemory | None = None
        self._hooks: list[RemovableHandle] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._seen += 1
        if self._seen > self.batch + 1:
            return
        self._meter = ActivationMemory(exclude=trainer.strategy.model)
        for layer in _layers(pl_module):
            self._hooks.append(layer.register_forward_hook(lambda *_: self._sample()))
        self._meter.__enter__()

    def _sample(self) -> None:
        if self._meter is not None:
            self._meter.sample()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._meter is not None and loss.grad_fn is not None:  # the whole graph waits for backward (not pp)
            self._meter.peak = self._meter.sample()  # the layers' ends saw the same plus transient buffers
        self._stop(pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._stop(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop(pl_module, log=False)

    def _stop(self, pl_module: pl.LightningModule, log: bool = True) -> None:
        if self._meter is None:
            return
        meter, self._meter = self._meter, None
        meter.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.bytes = meter.peak
        if log:
            pl_module.log("activation_bytes", float(self.bytes), on_step=True, on_epoch=False, sync_dist=False)


def _layers(pl_module: pl.LightningModule) -> list[Any]:
    try:
        return checkpoint_layers(pl_module)
    except AttributeError:  # pipeline_layers() of a model not built yet
        return []
