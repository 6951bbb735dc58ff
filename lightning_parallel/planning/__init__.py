"""Choosing a layout before launching: closed-form estimates (:mod:`.estimate`) from per-layer measurements of a
model built on the meta device (:mod:`.profile`); for models too large to profile, an analytic model from the
config alone (:mod:`.hf_config`, :mod:`.analytic`, :mod:`.cluster`, :mod:`.layout`, :mod:`.search`, checked
against :mod:`.published` runs). ``python -m lightning_parallel.plan`` is the command line.

May import: ``lightning_parallel.parallel`` (the schedule table, the sharding table, tensor-parallel styles,
partitions). Never Lightning, never the strategies.
"""
