"""Where the mesh strategies build a model and where they put it: Lightning glue over ``parallel/materialize.py``.

Under a layout that keeps a part of the model on each rank (pp, tp or ZeRO-3; ``splits_model``), no rank holds a
whole copy of the model that it did not build itself:

- **built outside any context** (``model = MyModule(); trainer.fit(model)``, the usual case): the host holds the
  whole model, as the user built it, and it stays there. The strategy does not move it to the device whole:
  :func:`~lightning_parallel.parallel.parallelize.parallelize` splits it (on the meta device under tp or ZeRO-3,
  the host values set aside) and each rank copies only its slices to its device; the host copy is then dropped.
- **built in** ``configure_model`` **or under** ``Trainer.init_module()``: on the meta device, so it is never
  whole anywhere, on the host or on a device; once split, each rank materializes its pieces and initializes them
  with the module's ``reset_parameters()`` (``protocol.reset_units``), the values a single process gets when it
  builds the module on the host with the same seed. The CPU generator's state is noted when building starts, so
  draws from the global generator replay from there (``empty_init`` changes nothing: values are always set).
- Otherwise (ZeRO 0-2 alone, with cp, ep or spatial beside it) every rank holds all the parameters by design:
  Lightning's own placement, the model moved to (or built on) the device whole.

What the model's own modules sync over once it is placed (BatchNorm statistics, torchmetrics) is here too:
:func:`sync_batchnorm_over_batch`, :func:`sync_metrics_over_batch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn
from torchmetrics import Metric

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.sync_batchnorm import convert_sync_batchnorm
from lightning_parallel.parallel.materialize import splits_model
from lightning_parallel.plugins.layer_sync import DataParallelSyncBatchNorm


@contextlib.contextmanager
def built_on_meta(runtime: Any, *contexts: contextlib.AbstractContextManager) -> Generator[None, None, None]:
    """A door's init context under a layout that splits the model (``Trainer.init_module()``, ``configure_model``,
    ``fabric.init_module()``): on the meta device, the CPU generator's state noted by the ``runtime``
    (:meth:`~lightning_parallel.strategies.runtime.MeshRuntime.built_on_meta`), inside ``contexts`` (the
    precision's)."""
    with runtime.built_on_meta(), contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def moves_whole(config: ParallelConfig, model: nn.Module) -> bool:
    """Whether ``model`` goes to the device whole before the split: only when every rank holds all of it (else
    parallelize() puts each rank's pieces on its device; a meta build: its materialize(device))."""
    return not splits_model(config) and not any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def sync_batchnorm_over_batch(
    model: nn.Module, sync: Any, config: ParallelConfig, batch_group: Any, warn: Callable[[str], Any]
) -> nn.Module:
    """``Trainer(sync_batchnorm=True)`` or a ``LayerSync`` plugin (``sync``; None: nothing): BatchNorm statistics
    over the ``batch`` role's ``batch_group`` (torch's SyncBatchNorm trains only on GPUs and syncs over the whole
    world, pp and tp ranks included; ours syncs over the data-parallel ranks on any device). Before tp, pp and
    ZeRO-3 wrap the BatchNorms' parameters; nothing reverts it. Returns the model to use."""
    if sync is None:
        return model
    if config.pp > 1 and config.microbatches != 1:
        warn(
            f"sync_batchnorm with pp={config.pp} and microbatches={config.microbatches}: BatchNorm statistics cover "
            "one microbatch of every dp rank, not the whole batch. Set microbatches=1 for the whole batch's "
            "statistics (the pipeline then runs its stages one after another)."
        )
    default = type(sync) is TorchSyncBatchNorm
    if default or (isinstance(sync, DataParallelSyncBatchNorm) and sync.process_group is None):
        return convert_sync_batchnorm(model, batch_group)
    return sync.apply(model)


def hide_example_input(module: Any) -> Any:
    """Lightning's model summary (and TensorBoard's graph) run ``example_input_array`` through the model on rank 0
    only: once the model is sharded or split, that forward starts collectives no other rank joins (seen as a crash
    at exit, or steps paired with the wrong collectives). Takes it off ``module``; returns it (None: none there),
    for the Trainer door to put back at teardown."""
    hidden = getattr(module, "example_input_array", None)
    if hidden is not None:
        module.example_input_array = None
    return hidden


def show_example_input(module: Any, hidden: Any) -> None:
    """The Trainer door's teardown: ``module``'s ``example_input_array`` back (:func:`hide_example_input`)."""
    if hidden is not None and module is not None:
        module.example_input_array = hidden


def sync_metrics_over_batch(model: nn.Module, batch_group: Any) -> None:
    """torchmetrics sync over the whole world by default; pp and tp ranks would count a batch twice."""
    for module in model.modules():
        if isinstance(module, Metric) and module.process_group is None:
            module.process_group = batch_group
