"""The mesh strategies under Lightning Fabric: the Trainer's names and settings, one implementation underneath.

``import lightning_parallel`` registers ``hybrid3d``, ``zero1``, ``zero2``, ``zero3`` and the ``_offload`` names in
Fabric's registry, so ``Fabric(strategy="zero3")`` works; the classes take the same settings as the Trainer's
(``Hybrid3DFabricStrategy(tp=2, sequence_parallel=True)``).
"""

from lightning_parallel.fabric.presets import Hybrid3DFabricStrategy, ZeroFabricStrategy, register_fabric_strategies
from lightning_parallel.fabric.strategy import MeshFabricStrategy

__all__ = ["Hybrid3DFabricStrategy", "MeshFabricStrategy", "ZeroFabricStrategy", "register_fabric_strategies"]
