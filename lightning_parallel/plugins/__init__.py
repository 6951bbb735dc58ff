"""Lightning plugins for the mesh strategies: precision with mesh-wide clipping and fp16 loss scaling
(:mod:`.precision`), and BatchNorm synced over the data-parallel axis (:mod:`.layer_sync`).

May import: Lightning and ``lightning_parallel.parallel``. Never ``lightning_parallel.strategies``.
"""
