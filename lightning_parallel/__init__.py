"""PyTorch Lightning strategies for models that outgrow one device.

``import lightning_parallel`` registers the strategy names (``hybrid3d``, ``zero1``, ``zero2``,
``zero3``, ``zero3_offload``, ...) in Lightning's registry, so ``Trainer(strategy="zero2")`` works, and
lets ``precision="16-mixed"`` on CPU run fp16 under them (Lightning alone would switch it to bf16).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.mesh import ParallelDims
from lightning_parallel.strategies import Hybrid3DStrategy, MeshStrategy, ZeroStrategy
from lightning_parallel.strategies.activation_checkpointing import ActivationCheckpointing, ActivationMemoryMonitor
from lightning_parallel.strategies.layer_sync import DataParallelSyncBatchNorm
from lightning_parallel.strategies.precision import keep_fp16_on_cpu

__version__ = "0.1.0"
__all__ = [
    "ActivationCheckpointing",
    "ActivationMemoryMonitor",
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
    keep_fp16_on_cpu()


register_strategies()
