"""PyTorch Lightning strategies for models that outgrow one device.

``import lightning_parallel`` registers the strategy names (``hybrid3d``, ``zero1``, ``zero2``,
``zero3``, ``zero3_offload``, ...) in Lightning's registry, so ``Trainer(strategy="zero2")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.mesh import ParallelDims
from lightning_parallel.strategies import Hybrid3DStrategy, MeshStrategy, ZeroStrategy
from lightning_parallel.strategies.layer_sync import DataParallelSyncBatchNorm

__version__ = "0.1.0"
__all__ = [
    "DataParallelSyncBatchNorm",
    "Hybrid3DStrategy",
    "MeshStrategy",
    "ParallelDims",
    "ZeroStrategy",
    "register_strategies",
]


def register_strategies() -> None:
    """Add this package's strategy names to Lightning's registry (idempotent)."""
    for cls in (ZeroStrategy, Hybrid3DStrategy):
        cls.register_strategies(StrategyRegistry)


register_strategies()
