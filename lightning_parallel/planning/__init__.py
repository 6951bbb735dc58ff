"""Choosing a layout before launching: closed-form estimates (:mod:`.estimate`) from per-layer measurements of a
model built on the meta device (:mod:`.profile`). ``python -m lightning_parallel.plan`` is the command line.

May import: ``lightning_parallel.parallel`` (the schedule table, the sharding table, tensor-parallel styles,
partitions). Never Lightning, never the strategies.
"""
