"""ZeRO 1/2/3 (and Lightning's ddp) at world 2 and 4 train exactly like one process on the same batch."""

from __future__ import annotations

import pytest
from conftest import PARITY_CASES, Batch
from parity import assert_same_losses, assert_same_params

STRATEGIES = ["zero1", "zero2", "zero3", "ddp"]
OFFLOAD = ["zero2_offload", "zero3_offload"]
OFFLOAD_CASES = [c for c in PARITY_CASES if c["name"] in ("plain", "clip")]
# bf16-mixed against one process, largest relative loss difference over 10 steps (torch 2.13 CPU, world 2):
#                     ddp, zero1, zero2   zero3 (bf16-gathered parameters)
#   tiny GPT              3.4e-5              2.3e-4; 5.5e-5 against ZeRO-3 in one process (hybrid3d at dp=1)
#   MoE GPT (ep=2)        1.4e-4              5.9e-4   (its router in bf16 instead of fp32: 5.9e-4 too)
# ZeRO 0-2 autocast from fp32 parameters and match Lightning's ddp bit for bit; ZeRO-3 computes from parameters
# gathered in bf16 (FSDP2's param_dtype, as torchtitan): the embedding's rows, norms' weights and each unit's inputs
# are bf16 where autocast would have kept fp32 (docs/precision.md); in one process that moves the loss by 2.2e-4.
# So ZeRO-3 is held to one process running the same math (the precision tests' bf16 bar, 9x margin) and to the
# autocast run within the bars below (4x and 2.5x margin).
BF16_RTOL = 1e-3
MOE_BF16_RTOL = 1.5e-3
SAME_MATH_BF16_RTOL = 5e-4
BF16 = [{"name": "bf16", "steps": 10, "precision": "bf16-mixed"}]
MOE_BF16 = [{"name": "bf16", "steps": 10, "precision": "bf16-mixed", "moe": {"moe_experts": 8, "moe_top_k": 2}}]
TOP_LEVEL = [{"name": "top", "steps": 6, "model": "top_level", "clip": 0.05}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    """Every run of this module, one launch per world size (1: the bf16 and top-level references)."""
    runs = {f"{s}-{w}": (w, s, PARITY_CASES) for s in STRATEGIES for w in (2, 4)}
    runs |= {s: (2, s, OFFLOAD_CASES) for s in OFFLOAD}
    runs |= {f"bf16-{s}": (1 if s == "auto" else 2, s, BF16) for s in ("auto", "ddp", "zero2", "zero3")}
    runs |= {f"top-{s}": (1 if s == "auto" else 2, s, TOP_LEVEL) for s in ("auto", "zero3")}
    runs |= {"bf16-moe-auto": (1, "auto", MOE_BF16), "bf16-moe-zero3": (2, "hybrid3d:ep=2,zero_stage=3", MOE_BF16)}
    runs["bf16-zero3-one"] = (1, "hybrid3d:zero_stage=3", BF16)  # ZeRO-3's math in one process (dp=1)
    return Batch(tmp_path_factory, runs, tag="zero")


# world 4 in `make test-full` (test budget: its launch); world 4 keeps ZeRO-3 at dp2 x tp2 in test_hybrid3d_parity.py
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_with_single_process(strategy, world, reference, runs):
    run = runs[f"{strategy}-{world}"]
    for case in PARITY_CASES:
        label = f"{strategy} world {world} {case['name']}"
        loss_rel = assert_same_losses(run.losses(case["name"]), reference.losses(case["name"]), label)
        param_abs = assert_same_params(run.params(case["name"]), reference.params(case["name"]), label)
        print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    for rank in range(world):  # sync_dist over dp: every rank reports the global validation loss
        got_val = run.case("plain", rank)["val_loss"]
        assert abs(got_val - want_val) <= 1e-5 * want_val, f"{strategy} rank {rank} val_loss {got_val} != {want_val}"


@pytest.mark.parametrize("strategy", OFFLOAD)
def test_offload_parity(strategy, reference, runs):
    for case in OFFLOAD_CASES:
        label = f"{strategy} {case['name']}"
        assert_same_losses(runs[strategy].losses(case["name"]), reference.losses(case["name"]), label)
        assert_same_params(runs[strategy].params(case["name"]), reference.params(case["name"]), label)


def test_bf16_mixed_parity(runs):
    single = runs["bf16-auto"].losses("bf16")
    ddp = runs["bf16-ddp"].losses("bf16")
    got = runs["bf16-zero2"].losses("bf16")
    for i, (g, d) in enumerate(zip(got, ddp)):  # fp32 parameters under autocast: Lightning's ddp bit for bit
        assert abs(g - d) <= 1e-6 * d, f"zero2 bf16 step {i}: {g} vs Lightning ddp {d}"
    one_zero3 = runs["bf16-zero3-one"].losses("bf16")
    cases = [("zero3", "bf16-zero3", single, BF16_RTOL), ("moe zero3", "bf16-moe-zero3", None, MOE_BF16_RTOL)]
    cases.append(("zero3 against zero3 in one process", "bf16-zero3", one_zero3, SAME_MATH_BF16_RTOL))
    for label, name, want, bar in cases:
        want = want or runs["bf16-moe-auto"].losses("bf16")
        got = runs[name].losses("bf16")
        print(f"{label} bf16-mixed: max loss rel diff {max(abs(g - w) / w for g, w in zip(got, want)):.1e} (bar {bar})")
        for i, (g, w) in enumerate(zip(got, want)):  # parameters gathered in bf16 (see BF16_RTOL)
            assert abs(g - w) <= bar * w, f"{label} bf16 step {i}: {g} vs single process {w}"


def test_zero3_with_the_lightning_module_as_a_unit(runs):
    """Tied weights across top-level layers put the LightningModule itself in a ZeRO-3 unit."""
    single, run = runs["top-auto"], runs["top-zero3"]
    assert_same_losses(run.losses("top"), single.losses("top"), "zero3 top-level model")
    assert_same_params(run.params("top"), single.params("top"), "zero3 top-level model")
