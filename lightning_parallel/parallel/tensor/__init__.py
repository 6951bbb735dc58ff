"""Tensor parallelism on the ``tp`` axis: DTensor plans for Linear/Embedding (:mod:`.plan`), the styles beyond
torch's that model plans use (:mod:`.styles`), channel splits for conv nets (:mod:`.conv`) and the
vocabulary-parallel loss (:mod:`.loss`). Pure torch.

May import: torch, :mod:`lightning_parallel._compat` and :mod:`lightning_parallel.parallel.dtensor`. Never Lightning.
"""
