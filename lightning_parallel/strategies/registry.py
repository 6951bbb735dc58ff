"""Putting the strategies where Lightning finds them: the registry names, and fp16 autocast on CPU.

``import lightning_parallel`` calls :func:`register_strategies`. Lightning 2.6 has no entry-point discovery
for strategies, so names resolve only after this ran.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel import _compat
from lightning_parallel.plugins.precision import MeshMixedPrecision
from lightning_parallel.strategies.async_ps import AsyncPSStrategy
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.hybrid3d import Hybrid3DStrategy
from lightning_parallel.strategies.zero import ZeroStrategy


def register_strategies() -> None:
    """Add this package's strategy names to Lightning's registry (idempotent)."""
    for cls in (ZeroStrategy, Hybrid3DStrategy):
        cls.register_strategies(StrategyRegistry)
    description = "asynchronous parameter servers (num_servers=1, staleness=0: synchronous)"
    StrategyRegistry.register("async_ps", AsyncPSStrategy, description=description, override=True)
    keep_fp16_on_cpu()


def keep_fp16_on_cpu() -> None:
    """Make ``Trainer(accelerator="cpu", precision="16-mixed")`` mean fp16 for the mesh strategies (idempotent).

    Lightning swaps ``16-mixed`` for ``bf16-mixed`` on CPU before any strategy sees the choice ("AMP with
    fp16 is not supported on CPU"), but torch's CPU autocast runs float16 (linear, matmul, attention and
    convolution in fp16, losses in fp32). This wraps the one Lightning method that makes the swap
    (``_compat.ACCELERATOR_CONNECTOR_PRECISION``), so that for a :class:`MeshStrategy` it returns fp16 autocast
    with our loss scaler; every other strategy keeps Lightning's behaviour.
    """
    connector_cls = _compat.AcceleratorConnector
    original = getattr(connector_cls, _compat.ACCELERATOR_CONNECTOR_PRECISION)
    if getattr(original, "_keeps_fp16_on_cpu", False):
        return

    def check_and_init_precision(connector: Any) -> Precision:
        if _compat.fp16_requested_on_cpu(connector) and isinstance(connector.strategy, MeshStrategy):
            _compat.validate_precision_choice(connector)
            rank_zero_info("Using 16bit Automatic Mixed Precision (AMP) on CPU, with mesh-wide loss scaling")
            return MeshMixedPrecision("16-mixed", device="cpu")
        return original(connector)

    check_and_init_precision._keeps_fp16_on_cpu = True  # type: ignore[attr-defined]
    setattr(connector_cls, _compat.ACCELERATOR_CONNECTOR_PRECISION, check_and_init_precision)
