"""Lightning callbacks that work under any strategy: activation checkpointing and activation memory
(:mod:`.activation`), throughput/MFU/memory/communication/timeline (:mod:`.monitor`), exact resume
(:mod:`.resume`), preemption on SIGTERM (:mod:`.preemption`) and the recipes' progress bar: steps and the loss
(:mod:`.progress`).

May import: Lightning and ``lightning_parallel.parallel``. Never ``lightning_parallel.strategies``.
"""
