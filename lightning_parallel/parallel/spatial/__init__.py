"""Spatial parallelism (``spatial``, on the ``cp`` mesh axis): each image split into strips of rows over the spatial
ranks. Pure torch.

``split.py`` the strips and their gather before the classifier, ``halo.py`` the rows convolutions borrow from the
neighbouring strips (and their gradients back), ``layout.py`` what a model must look like (checked on the meta
device, before launch), ``apply.py`` a model's convolutions, BatchNorms and classifier input switched over, the batch
split.
"""

from lightning_parallel.parallel.spatial.apply import SpatialParallel, apply_spatial_parallel
from lightning_parallel.parallel.spatial.halo import SENT, halo_bytes, halo_exchange
from lightning_parallel.parallel.spatial.layout import check_spatial_layout, conv_halo, trace_heights
from lightning_parallel.parallel.spatial.split import check_height, gather_strips, shard_height, unshard_height

__all__ = [
    "SENT",
    "SpatialParallel",
    "apply_spatial_parallel",
    "check_height",
    "check_spatial_layout",
    "conv_halo",
    "gather_strips",
    "halo_bytes",
    "halo_exchange",
    "shard_height",
    "trace_heights",
    "unshard_height",
]
