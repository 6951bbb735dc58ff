"""Model states and data-parallel traffic with LoRA adapters on a frozen base. Pure Python.

The frozen base has no gradient and no optimizer state: its bytes are its parameters alone, split by tp and pp and
sharded over dp only under ZeRO-3 (the one stage that shards parameters). The adapters train in fp32 with AdamW:
16 bytes per parameter (parameter, gradient, two states), sharded over dp as the ZeRO stage shards them
(:mod:`lightning_parallel.parallel.data.stages`). Gradients are reduced for the adapters alone; under ZeRO-3 the
base is still all-gathered for forward and again for backward.
"""

from __future__ import annotations

import math
import re

from torch import nn

from lightning_parallel.parallel.data.stages import zero_stage as zero_stage_of

ADAPTER_ELEMENT_BYTES = 4  # fp32 adapters, whatever the base's dtype
ADAPTER_OPTIMIZER_STATES = 2  # AdamW's exp_avg and exp_avg_sq: 4 + 4 + 2 x 4 = 16 bytes per adapter parameter


def adapter_model_state_bytes(
    base_params: int,
    adapter_params: int,
    *,
    zero_stage: int,
    dp: int,
    tp: int,
    pp: int,
    base_bytes_per_param: int,
) -> int:
    """Model-state bytes on one rank of a frozen base with trained adapters.

    Args:
        base_params: the frozen base's parameters (the whole model's; tp and pp split them evenly).
        adapter_params: the adapters' parameters (the whole model's; tp and pp split them evenly). The planner
            passes one rank's exact counts with ``tp=pp=1``.
        zero_stage: 0..3: which of the adapters' parameters, gradients and optimizer states are sharded over dp;
            the base's parameters are sharded at stage 3 only.
        dp: the data-parallel ranks the states are sharded over.
        tp: tensor-parallel degree; pp: pipeline-parallel degree.
        base_bytes_per_param: bytes of one base parameter (4 fp32, 2 bf16).

    Returns:
        The base's bytes plus the adapters' 16 bytes per parameter, the sharded parts rounded up (flat buffers
        and FSDP2's shards are padded).
    """
    sharding = zero_stage_of(zero_stage)
    base = math.ceil(base_params / (tp * pp)) * base_bytes_per_param
    if "params" in sharding.sharded:
        base = math.ceil(base / dp)
    adapters = math.ceil(adapter_params / (tp * pp))
    return base + sharding.state_bytes_exact(adapters, dp, ADAPTER_ELEMENT_BYTES, ADAPTER_OPTIMIZER_STATES)


def adapter_comm_bytes(base_bytes: float, adapter_params: int, *, zero_stage: int, dp: int) -> float:
    """Bytes one rank sends over dp per step: the adapters' fp32 gradients reduced as the stage reduces them, and
    under ZeRO-3 the frozen base's ``base_bytes`` all-gathered twice (forward, backward), (dp-1)/dp each.

    Args:
        base_bytes: the frozen base's bytes on this rank before dp sharding (its tp shard of its pp stage).
        adapter_params: the adapters' parameters on this rank before dp sharding.
        zero_stage: 0..3; dp: the data-parallel ranks.
    """
    if dp == 1:
        return 0.0
    sharding = zero_stage_of(zero_stage)
    sent = sharding.comm_bytes(adapter_params * ADAPTER_ELEMENT_BYTES, dp)
    if "params" in sharding.sharded:
        sent += 2 * base_bytes * (dp - 1) / dp
    return sent


def lora_params(layer: nn.Module, prefix: str, rank: int, targets: str) -> int:
    """LoRA parameters of rank ``rank`` on the linear layers of ``layer`` whose path (``prefix.name``) matches the
    regex ``targets``: A (r x in) and B (out x r) each. On a copy cut to one tp rank's shard this is that rank's
    count: a column-parallel base keeps A whole and splits B's out, a row-parallel one splits A's in and keeps B
    whole, so r x (local in + local out) either way."""
    count = 0
    for name, module in layer.named_modules():
        path = f"{prefix}.{name}" if prefix and name else name or prefix
        if isinstance(module, nn.Linear) and re.search(targets, path):
            out_features, in_features = module.weight.shape
            count += rank * (in_features + out_features)
    return count
