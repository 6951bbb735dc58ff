"""Measurement, on any device: model-state and activation bytes (:mod:`.memory`), bytes each collective moves
(:mod:`.comm_volume`), FLOPs and peak device throughput (:mod:`.flops`), and the pipeline timeline
(:mod:`.timeline`). Pure torch (+ matplotlib for drawing).

May import: torch only (it is imported by the parallelisms, never the other way round). Never Lightning.
"""
