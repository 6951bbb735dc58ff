"""MuonAdamW (ns_dtype=float32, fp32, 10 steps, plain and clipped) under the layouts that do not split matrices
themselves but place them: pipeline stages (1F1B and interleaved), cp=2, HSDP 2 x 2, ZeRO-0 with each matrix on one
owner, ep=2 (the MoE GPT: each expert's matrix orthogonalized alone, not the stacked 3-D tensor), against the same
optimizer in one process: losses within 1e-5 relative, parameters within 1e-5. Each run also says how many
matrices each rank orthogonalized: summed over the ranks, the reference's count (each matrix once), and every rank
some of them."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_losses, assert_same_params

MOE = {"moe_experts": 8, "moe_top_k": 2}  # block 1 of the 2-block GPT: 8 experts of (32, 128) and (128, 32)
CASES = [
    {"name": "plain", "steps": 10, "optimizer": "muon"},
    {"name": "clip", "steps": 10, "clip": 0.05, "optimizer": "muon"},
]
MOE_CASES = [{**case, "moe": MOE} for case in CASES]
LAYOUTS = {  # label -> (world, strategy, MoE, loss ranks (one per dp x cp index), times each matrix is done)
    "pp2-1f1b": (2, "hybrid3d:pp=2", False, [0], 1),
    "pp2-interleaved": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", False, [0], 1),
    "cp2": (2, "hybrid3d:cp=2", False, [0, 1], 1),
    "ep2": (2, "hybrid3d:ep=2", True, [0, 1], 1),
    "ep2-zero1": (2, "hybrid3d:ep=2,zero_stage=1", True, [0, 1], 1),  # experts in ZeRO-1's flat buffer
    "ep2-zero3": (2, "hybrid3d:ep=2,zero_stage=3", True, [0, 1], 1),
    "hsdp2x2": (4, "hybrid3d:dp_shard=2,zero_stage=3", False, [0, 1, 2, 3], 1),  # owners over replicas x shards
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    table = {label: (world, spec, MOE_CASES if moe else CASES) for label, (world, spec, moe, *_) in LAYOUTS.items()}
    table["reference"] = (1, "auto", CASES)
    table["reference-moe"] = (1, "auto", MOE_CASES)
    return Batch(tmp_path_factory, table, tag="muon_layouts")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_muon_layout_parity(runs, label):
    world, _, moe, leaders, times = LAYOUTS[label]
    reference = runs["reference-moe" if moe else "reference"]
    for case in CASES:
        name = case["name"]
        rel = assert_same_losses(runs[label].losses(name, leaders), reference.losses(name), f"muon {label} {name}")
        diff = assert_same_params(runs[label].params(name), reference.params(name), f"muon {label} {name}")
        print(f"muon {label} {name}: max loss rel diff {rel:.1e}, max param abs diff {diff:.1e}")
    done = [runs[label].case("plain", r)["muon_exchange"].get("orthogonalized", 0) for r in range(world)]
    want = reference.case("plain")["muon_exchange"]["orthogonalized"]
    assert sum(done) == times * want, (label, done, want)  # each matrix once
    assert all(d > 0 for d in done), (label, done)  # and every rank takes a share
    print(f"muon {label}: matrices orthogonalized per rank {done} (one process: {want})")
    if label == "hsdp2x2":  # R = 2 replicas x S = 2 shards: 2 b (S - 1) P / (R S^2) + b (R - 1) P / (R S) per rank
        sent = [runs[label].case("plain", r)["muon_exchange"]["sent_bytes"] for r in range(world)]
        P = 2 * (4 * 32 * 32 + 2 * 128 * 32)  # noqa: N806  (the docs' name)
        assert sent == [2 * 4 * P // (2 * 4) + 4 * P // (2 * 2)] * world, sent


@pytest.mark.slow
def test_experts_are_orthogonalized_one_by_one(runs):
    """The MoE GPT's reference orthogonalizes 12 + 4 dense matrices (block 1: attention and the router) and 16 expert
    matrices (8 experts x w1, w2): each expert alone, not its stack as one (32, 8 x 128) matrix."""
    dense = runs["reference"].case("plain")["muon_exchange"]["orthogonalized"]
    moe = runs["reference-moe"].case("plain")["muon_exchange"]["orthogonalized"]
    assert dense == 12 and moe == 2 * 4 + 2 + 1 + 16  # block 0: attn 4 + mlp 2; block 1: attn 4, router 1, experts
