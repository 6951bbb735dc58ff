"""PyTorch Lightning strategies for models that outgrow one device.

``import lightning_parallel`` registers the strategy names (``hybrid3d``, ``zero1``, ``zero2``,
``zero3``, ``zero3_offload``, ...) in Lightning's registry and in Fabric's, so ``Trainer(strategy="zero2")`` and
``Fabric(strategy="zero2")`` work. That is the import's one side effect: nothing of Lightning's is patched.

The layout of the package is described in ARCHITECTURE.md at the repository root.
"""

from lightning_parallel.callbacks.activation import ActivationCheckpointing, ActivationMemoryMonitor
from lightning_parallel.callbacks.moe import MoEAuxLossScale, MoEMonitor
from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.callbacks.preemption import Preemption
from lightning_parallel.callbacks.resume import ExactResume, ResumableDataLoader
from lightning_parallel.fabric import Hybrid3DFabricStrategy, ZeroFabricStrategy, register_fabric_strategies
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.expert import MoE
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.plugins.layer_sync import DataParallelSyncBatchNorm
from lightning_parallel.protocol import ParallelModule
from lightning_parallel.strategies import AsyncPSStrategy, Hybrid3DStrategy, MeshStrategy, ZeroStrategy
from lightning_parallel.strategies.registry import register_strategies

__version__ = "0.1.0"
__all__ = [
    "ActivationCheckpointing",
    "ActivationMemoryMonitor",
    "AsyncPSStrategy",
    "DataParallelSyncBatchNorm",
    "ExactResume",
    "Hybrid3DFabricStrategy",
    "Hybrid3DStrategy",
    "MeshStrategy",
    "MoE",
    "MoEAuxLossScale",
    "MoEMonitor",
    "ParallelConfig",
    "ParallelDims",
    "ParallelModule",
    "Preemption",
    "ResumableDataLoader",
    "TrainingMonitor",
    "ZeroFabricStrategy",
    "ZeroStrategy",
    "register_strategies",
]

register_strategies()
register_fabric_strategies()
