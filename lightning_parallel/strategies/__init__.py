"""Lightning adapters: thin strategy classes over the pure-torch pieces in ``lightning_parallel.parallel``."""

from lightning_parallel.strategies.async_ps import AsyncPSStrategy
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.hybrid3d import Hybrid3DStrategy
from lightning_parallel.strategies.zero import ZeroStrategy

__all__ = ["AsyncPSStrategy", "Hybrid3DStrategy", "MeshStrategy", "ZeroStrategy"]
