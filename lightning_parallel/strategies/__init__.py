"""Lightning adapters: thin strategy classes over the pure-torch pieces in ``lightning_parallel.parallel``."""

from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.zero import ZeroStrategy

__all__ = ["MeshStrategy", "ZeroStrategy"]
