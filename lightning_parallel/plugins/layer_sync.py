"""Lightning's ``LayerSync`` plugin for :mod:`lightning_parallel.parallel.data.sync_batchnorm`: BatchNorm
statistics over the data-parallel batch, on CPU as on GPU."""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch.plugins import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_parallel.parallel.data.sync_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm


class DataParallelSyncBatchNorm(LayerSync):
    """Swap every BatchNorm for one whose training statistics cover the whole data-parallel batch.

    Pass it as ``Trainer(plugins=[DataParallelSyncBatchNorm()])``. Lightning's ``ddp`` and ``fsdp`` call
    :meth:`apply` before wrapping the model and :meth:`revert` after fitting; this package's strategies
    (``hybrid3d``, ``zero*``) apply it over their dp axis before tensor parallelism and sharding, and also take
    ``Trainer(sync_batchnorm=True)`` to mean this plugin. Unlike Lightning's own ``TorchSyncBatchNorm`` (what
    ``sync_batchnorm=True`` gives under ``ddp``; on CPU it fails with "SyncBatchNorm layers only work with GPU
    modules") it trains on CPU too. Lightning refuses the two together ("You set `Trainer(sync_batchnorm=True)`
    and provided a `DataParallelSyncBatchNorm` plugin, but this is not allowed"): choose one.

    Args:
        process_group: the ranks whose batches together make the batch. None: the whole world under Lightning's
            strategies, the dp axis of the mesh under this package's.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group

    @override
    def apply(self, model: Module) -> Module:
        """Convert ``model``'s BatchNorms in place (parameters and running statistics kept); returns it."""
        return convert_sync_batchnorm(model, self.process_group)

    @override
    def revert(self, model: Module) -> Module:
        """Turn the synced BatchNorms back into torch's plain ones; returns ``model``."""
        return revert_sync_batchnorm(model)
