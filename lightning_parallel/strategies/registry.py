"""Putting the strategies where Lightning finds them: the registry names.

``import lightning_parallel`` calls :func:`register_strategies`. Lightning 2.6 has no entry-point discovery
for strategies, so names resolve only after this ran. It is the import's one side effect (with Fabric's registry):
nothing of Lightning's is patched. fp16 on CPU is asked for explicitly
(:func:`~lightning_parallel.plugins.precision.cpu_fp16_plugin`).
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.async_ps import AsyncPSStrategy
from lightning_parallel.strategies.hybrid3d import Hybrid3DStrategy
from lightning_parallel.strategies.zero import ZeroStrategy


def register_strategies() -> None:
    """Add this package's strategy names to Lightning's registry (idempotent)."""
    for cls in (ZeroStrategy, Hybrid3DStrategy):
        cls.register_strategies(StrategyRegistry)
    description = "asynchronous parameter servers (num_servers=1, staleness=0: synchronous)"
    StrategyRegistry.register("async_ps", AsyncPSStrategy, description=description, override=True)
