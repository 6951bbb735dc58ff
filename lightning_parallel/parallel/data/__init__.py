"""Data parallelism on the mesh's ``shard``/``replicate`` roles: one sharding object per ZeRO stage
(:mod:`.sharding` holds the interface and the table of stages; :mod:`.replicate` stage 0, :mod:`.flat_zero`
stages 1-2, :mod:`.fsdp` stage 3) and BatchNorm synced over the data-parallel batch (:mod:`.sync_batchnorm`).
Pure torch.

May import: torch, :mod:`lightning_parallel.parallel.dtensor`, ``parallel.clip`` (gradient parts).
Never Lightning, never ``parallel.pipeline`` or ``parallel.tensor``.
"""
