"""Tensor parallelism on the ``tp`` axis: DTensor plans for Linear/Embedding (:mod:`.plan`), channel splits for
conv nets (:mod:`.conv`) and the vocabulary-parallel loss (:mod:`.loss`). Pure torch.

May import: torch and :mod:`lightning_parallel.parallel.dtensor`. Never Lightning.
"""
