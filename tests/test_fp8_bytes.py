"""ZeRO-3 all-gather bytes of one steady step with float8 all-gather against bf16-mixed's, counted at world 2
(tests/workers/cases/collectives.py, ``CommCounter``, payload bytes of every dtype: FSDP2 packs a unit of mixed dtypes
into one uint8 buffer).

The formula: ``fp8_ag = bf16 - sum over converted weights of gathers x numel x (2 - 1)`` bytes. Each converted weight
crosses the wire in float8 (1 byte an element) instead of bf16 (2); whatever stays in high precision (embeddings, the
head, norms, biases: ``Float8Settings.keep`` and the non-Linear modules) keeps its bf16 bytes. ``gathers`` is 2: the
blocks' units gather in forward and again in backward (ZeRO-3 reshards after forward); the tiny GPT's dimensions
divide by the world, so no shard is padded. Without float8 all-gather, fp8 gathers exactly bf16's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_worker
from workers.cases.common import TINY

from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.parallel.float8 import Float8Settings, convert, converted_weights

SPECS = ["zero3+bf16", "zero3+fp8", "zero3+fp8ag"]
GATHERS = 2  # forward, and backward's re-gather


def gathered(bytes_by_kind: dict[str, int]) -> int:
    return sum(n for key, n in bytes_by_kind.items() if key.startswith("all_gather:"))


@pytest.mark.slow
def test_float8_all_gather_bytes_follow_the_formula(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_bytes")
    ranks = run_worker("collectives", 2, ["--opts", json.dumps({"specs": SPECS})], out, timeout=300)
    counted = ranks[0]
    bf16, fp8, fp8_ag = (gathered(counted[s]["bytes"]) for s in SPECS)
    model = RecipeGPT(TINY)
    convert(model, Float8Settings(), torch.device("cpu"))
    params = dict(model.named_parameters())
    converted = sum(params[name].numel() for name in converted_weights(model))
    expected = bf16 - GATHERS * converted * (2 - 1)
    print(
        f"zero3 world 2, one step, all-gather bytes: bf16-mixed {bf16}, fp8 {fp8}, fp8 + float8 all-gather {fp8_ag} "
        f"(formula {expected}: {converted} converted weight elements)"
    )
    assert converted > 0 and fp8 == bf16
    assert fp8_ag == expected
    assert counted["zero3+fp8ag"]["param_dtypes"] == ["torch.float32"]  # fp32 master weights
