"""Gradient compression on the data-parallel reduction: what dtype the gradients travel in. Pure torch.

``grad_compression="bf16"`` or ``"fp16"`` casts each flat gradient bucket to 16 bits after dividing it by the
data-parallel size (so the sum stays in range), reduces it in that dtype, and casts the result back into the fp32
gradients: half the bytes on the wire, the rounding of a 16-bit sum in the result (ZeRO-3: FSDP2's
``reduce_dtype``, the same idea). The optimizer still steps fp32 gradients and weights.
"""

from __future__ import annotations

import torch

# powersgd: low-rank factors of each gradient matrix (parallel/data/powersgd.py), the rest in fp32
GRAD_COMPRESSION: dict[str, torch.dtype | None] = {
    "none": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "powersgd": None,
}


def check_grad_compression(value: object, name: str = "grad_compression") -> None:
    if value not in GRAD_COMPRESSION:
        raise ValueError(f"{name}={value!r} is unknown: use one of {', '.join(map(repr, GRAD_COMPRESSION))}.")


def wire_dtype(compression: str) -> torch.dtype | None:
    """The dtype gradients are reduced in (None: their own)."""
    return GRAD_COMPRESSION[compression]
