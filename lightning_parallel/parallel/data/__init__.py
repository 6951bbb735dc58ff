"""Data parallelism on the mesh's ``shard``/``replicate`` roles: shardings registered by name (:mod:`.sharding`
holds the interface and the registry, :mod:`.stages` maps ZeRO stages to names; :mod:`.replicate` stage 0,
:mod:`.flat_zero` stages 1-2, :mod:`.fsdp` stage 3, each reading HSDP's replicas from the mesh) and BatchNorm synced
over the data-parallel batch (:mod:`.sync_batchnorm`).
Pure torch.

May import: torch, :mod:`lightning_parallel.parallel.dtensor`, ``parallel.clip`` (gradient parts).
Never Lightning, never ``parallel.pipeline`` or ``parallel.tensor``.
"""
