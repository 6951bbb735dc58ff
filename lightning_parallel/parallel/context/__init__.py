"""Context parallelism (the ``cp`` axis): each sample's sequence split over cp ranks. Pure torch.

``split.py`` the load-balanced split (two mirrored chunks per rank) and its inverse, ``ring.py`` exact causal ring
attention (keys and values around the ring, exchanges overlapped with compute, online-softmax merge), ``kernels.py``
its block kernels (fused CPU / CUDA flash or memory-efficient, picked by device, and their unfused twin),
``ulysses.py`` the all-to-all mode (heads split over cp for the attention), ``apply.py`` a model's attention and
positions switched over, the batch split.
"""

from lightning_parallel.parallel.context.apply import (
    ContextParallel,
    apply_context_parallel,
    check_context_layout,
    whole_sequence,
)
from lightning_parallel.parallel.context.ring import ring_attention, ring_bytes
from lightning_parallel.parallel.context.split import check_sequence, positions, shard_sequence, unshard_sequence
from lightning_parallel.parallel.context.ulysses import check_heads, ulysses_attention

__all__ = [
    "ContextParallel",
    "apply_context_parallel",
    "check_context_layout",
    "check_heads",
    "check_sequence",
    "positions",
    "ring_attention",
    "ring_bytes",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "whole_sequence",
]
