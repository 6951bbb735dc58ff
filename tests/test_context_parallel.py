"""Context parallelism (cp): the attention against plain causal attention, and training against one process.

Attention (tests/workers/context_worker.py, world 2 and 4): ring and Ulysses attention on each rank's two mirrored
chunks give the rows and the q, k, v gradients of ``scaled_dot_product_attention(is_causal=True)`` on the whole
sequence; the ring sends exactly the bytes of ``ring_bytes``. Training (tests/workers/gpt_worker.py): fp32, 10 AdamW
steps, plain / clipped / accumulated, the tiny GPT (sequence 16: 2 x cp chunks of 4 at cp=2, of 2 at cp=4); losses
within 1e-5 relative and parameters within 1e-5 of the single-process run.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch
from conftest import PARITY_CASES, Batch
from harness import run_distributed
from parity import assert_same_losses, assert_same_params

from lightning_parallel.parallel.context import check_heads, check_sequence, positions, shard_sequence
from lightning_parallel.parallel.context import ring_bytes, unshard_sequence

ATTENTION_CASES = [
    {"name": "ring", "mode": "ring", "seq_len": 16},
    {"name": "ring-long", "mode": "ring", "seq_len": 24, "batch": 1, "heads": 2, "head_dim": 16},
    {"name": "ring-fp64", "mode": "ring", "seq_len": 16, "dtype": "float64"},
    {"name": "ulysses", "mode": "ulysses", "seq_len": 16},
]


# ----- the split, without any process group -----


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_inverse(cp):
    x = torch.arange(2 * 4 * cp * 3).reshape(2, 4 * cp, 3)  # 2 samples of 4cp tokens: 2cp chunks of 2
    pieces = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(p.shape == (2, 4, 3) for p in pieces)
    assert torch.equal(unshard_sequence(pieces), x)
    # each rank holds chunk r and its mirror 2cp - 1 - r; the positions say which tokens those are
    for r, piece in enumerate(pieces):
        assert torch.equal(piece[0, :, 0] // 3, positions(4, cp, r))
    assert positions(4, 2, 0).tolist() == [0, 1, 6, 7] and positions(4, 2, 1).tolist() == [2, 3, 4, 5]


def test_causal_work_is_balanced():
    """Keys each rank's queries attend to (causal): the same on every rank with the mirrored chunks."""
    for cp in (2, 4, 8):
        work = [int((positions(8, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1, work


def test_bad_splits_name_the_setting():
    with pytest.raises(ValueError, match=r"cp=3 splits each sequence into 2 \* cp = 6"):
        check_sequence(16, 3)
    with pytest.raises(ValueError, match=r"cp_mode='ulysses' with cp=4 .* n_head / tp = 8 / 4 = 2"):
        check_heads(8, 4, tp=4)
    check_heads(8, 4, tp=2)


# ----- the attention, on 2 and 4 processes -----


@pytest.mark.parametrize("world", [2, 4])
def test_attention_matches_plain_causal_attention(world, tmp_path):
    ranks = run_distributed("context_worker.py", world, ["--cases", json.dumps(ATTENTION_CASES)], tmp_path)
    for rank, results in enumerate(ranks):
        for got in results:
            bar = 1e-12 if got["name"].endswith("fp64") else 2e-6
            label = f"cp={world} rank {rank} {got['name']}"
            assert got["out"] <= bar, f"{label}: output off by {got['out']:.1e}"
            assert max(got["grads"]) <= bar, f"{label}: q, k, v gradients off by {got['grads']}"
            if got["mode"] == "ring":
                assert got["sent"] == ring_bytes(got["kv_bytes"], world), f"{label}: ring bytes {got['sent']}"
