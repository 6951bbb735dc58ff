"""Model states and data-parallel traffic with low-rank adapters (LoRA) on a frozen base. Pure Python.

A frozen base holds parameters only: no gradient and no optimizer state anywhere, so ZeRO 0-2 leave it whole on
every rank and only ZeRO-3 shards it (besides tp and pp, which split every weight they place). The adapters train
as any parameter does: fp32 parameter (4 bytes), gradient (4) and AdamW's two moments (8), 16 bytes per parameter,
sharded by the ZeRO stage's row of the sharding table (ZeRO-1: the optimizer states; ZeRO-2: and the gradients;
ZeRO-3: everything). Gradients are reduced for the adapters alone; under ZeRO-3 the base is still all-gathered for
forward and again for backward. tests/test_hf_lora_memory.py counts the bytes each rank holds from its tensors and
checks them against :func:`adapter_model_state_bytes`; the planner (planning/estimate.py) calls it too.
"""

from __future__ import annotations

import math
import re

from torch import nn

from lightning_parallel.parallel.data.stages import stage_sharding as zero_stage_of

ADAPTER_BYTES_PER_PARAM = 4  # fp32: adapters and their gradients and optimizer states stay fp32 under a bf16 base


def adapter_model_state_bytes(
    base_params: int,
    adapter_params: int,
    *,
    zero_stage: int,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    base_bytes_per_param: int,
    optimizer_states: int = 2,
) -> int:
    """Bytes of parameters, gradients and optimizer states one rank holds: the frozen base's parameters (sharded
    over dp under ZeRO-3 only) plus the adapters' ``(2 + optimizer_states) * 4`` bytes per parameter (16 for
    AdamW), sharded as ``zero_stage`` shards them.

    tp and pp are taken to split the base and the adapters evenly: the planner's estimate. They do not quite:
    under tp the replicated tensors (norms; each LoRA layer's factor on the unsplit side: ``lora_A`` of a
    column-parallel base, ``lora_B`` of a row-parallel one) are whole on every tp rank, and pipeline stages
    differ. For exact bytes pass what one rank holds (its tp shard of its stage) with ``tp=pp=1``. The sharded
    parts are rounded up, as ZeRO's flat buffers and FSDP2's shards are padded to a multiple of dp.

    Args:
        base_params: elements of the frozen base (the whole model's, or one rank's with ``tp=pp=1``).
        adapter_params: elements of the trainable adapters, counted the same way.
        zero_stage: 0-3.
        dp: data-parallel degree (the ranks the ZeRO stage shards over).
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        base_bytes_per_param: bytes of one base element (2 for a bf16 base, 4 for fp32).
        optimizer_states: optimizer-state tensors per adapter parameter (AdamW: 2).

    Returns:
        Bytes per rank.

    Raises:
        ValueError: a degree below 1, a negative count, or an unknown ZeRO stage.
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("base_bytes_per_param", base_bytes_per_param)):
        if value < 1:
            raise ValueError(f"adapter_model_state_bytes({name}={value}): must be at least 1.")
    if base_params < 0 or adapter_params < 0:
        raise ValueError(
            f"adapter_model_state_bytes(base_params={base_params}, adapter_params={adapter_params}): counts must be "
            ">= 0."
        )
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"adapter_model_state_bytes(zero_stage={zero_stage!r}): use 0, 1, 2 or 3.")
    sharding = zero_stage_of(zero_stage)
    base = math.ceil(base_params / (tp * pp))
    if "params" in sharding.sharded:
        base = math.ceil(base / dp)
    adapters = math.ceil(adapter_params / (tp * pp))
    states = sharding.state_bytes_exact(adapters, dp, ADAPTER_BYTES_PER_PARAM, optimizer_states)
    return base * base_bytes_per_param + states


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
    sent = sharding.comm_bytes(adapter_params * ADAPTER_BYTES_PER_PARAM, dp)
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
