"""FLOPs a rank computes, the peak a device can, and the process's peak memory. Pure torch.

``LocalFlopCounter`` counts with ``torch.utils.flop_counter``'s formulas on local shards (torch's own
``FlopCounterMode`` counts a tensor-parallel op at its global size on every rank).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from lightning_parallel._compat import TorchDispatchMode

# Dense (no sparsity) peak FLOP/s per GPU from NVIDIA's datasheets: (bf16, fp16, tf32, fp32). Matched against
# torch.cuda.get_device_name() in this order, so the specific names come before the generic ones.
PEAK_FLOPS: list[tuple[str, tuple[float | None, float | None, float | None, float]]] = [
    ("H200 NVL", (835e12, 835e12, 418e12, 60e12)),
    ("H200", (989e12, 989e12, 494.5e12, 67e12)),
    ("H100 NVL", (835e12, 835e12, 418e12, 60e12)),
    ("H100 PCIe", (756e12, 756e12, 378e12, 51e12)),
    ("H100", (989e12, 989e12, 494.5e12, 67e12)),  # SXM
    ("GH200", (989e12, 989e12, 494.5e12, 67e12)),
    ("A100", (312e12, 312e12, 156e12, 19.5e12)),
    ("L40S", (362e12, 362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 121e12, 60e12, 30.3e12)),
    ("A10", (125e12, 125e12, 62.5e12, 31.2e12)),
    ("V100", (None, 125e12, None, 15.7e12)),
]
_PRECISION_COLUMN = {"bf16": 0, "fp16": 1, "tf32": 2, "fp32": 3}


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype`` (``bf16``, ``fp16``, ``tf32`` or ``fp32``), or None when
    the device is not in :data:`PEAK_FLOPS` (any CPU).

    Args:
        device_name: what ``torch.cuda.get_device_name()`` says, e.g. ``"NVIDIA H100 80GB HBM3"``.
        dtype: the precision the matmuls run in.
    """
    if dtype not in _PRECISION_COLUMN:
        raise ValueError(f"dtype={dtype!r} is unknown: use one of {', '.join(_PRECISION_COLUMN)}.")
    if not device_name:
        return None
    for name, row in PEAK_FLOPS:
        if name in device_name:
            return row[_PRECISION_COLUMN[dtype]]
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype the matmuls of a Lightning precision flag run in (fp32 as TF32 where torch allows it)."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


class LocalFlopCounter(TorchDispatchMode):
    """Counts the FLOPs this rank computes while active, with ``torch.utils.flop_counter``'s formulas.

    ``FlopCounterMode`` itself counts a DTensor op at its global size on every rank (a tensor-parallel matmul
    counted tp times over); here DTensor ops are first let through to run on their local shards.

    Attributes:
        flops: the count so far.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs the op on local shards, which come back here
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func.namespace != "prim":  # a composite op: count what it decomposes into, as
            # FlopCounterMode does (prim ops, such as prim::device under a fake mode, have no decomposition)
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA's allocated bytes, or on CPU the peak resident memory."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
