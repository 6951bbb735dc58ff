"""Gradient reduction overlapped with backward (``overlap_grad_reduce``, ZeRO 0 and 1): every bucket is launched
during the last backward of each step, and the training equals the reduction after backward bitwise where the sums
are the same sums (2 data-parallel ranks: a + b), within float rounding where a ring orders them differently."""

from __future__ import annotations

import pytest
from conftest import Batch

CASES = [{"name": "plain", "steps": 10}, {"name": "accumulate", "steps": 10, "accumulate": 2, "clip": 0.05}]
OVERLAP = ",overlap_grad_reduce=1,bucket_mb=0.05"  # small buckets: the tiny GPT's 0.2 MB in several
LAYOUTS = {  # label: (world, strategy, bitwise)
    "dp2-zero0": (2, "hybrid3d:dp=2", True),
    "dp2-zero1": (2, "hybrid3d:dp=2,zero_stage=1", True),
    "dp2-tp2-zero0": (4, "hybrid3d:dp=2,tp=2", True),  # DTensor gradients, placed before they travel
    "dp4-zero1": (4, "hybrid3d:dp=4,zero_stage=1", False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    spec = {}
    for label, (world, strategy, _) in LAYOUTS.items():
        spec[label] = (world, strategy, CASES)
        spec[f"{label}-overlap"] = (world, strategy + OVERLAP, CASES)
    return Batch(tmp_path_factory, spec, tag="overlap")


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_overlapped_reduction_equals_the_reduction_after_backward(runs, label):
    world, _, bitwise = LAYOUTS[label]
    after, during = runs[label], runs[f"{label}-overlap"]
    for case in CASES:
        name = case["name"]
        for rank in range(world):
            stats = during.case(name, rank)["overlap"]
            assert stats["buckets"] > 1 and stats["launched_in_backward"] == stats["buckets"], stats
            assert after.case(name, rank)["overlap"] == {}
        want, got = after.params(name), during.params(name)
        worst = max((want[k].float() - got[k].float()).abs().max().item() for k in want)
        print(f"{label} {name}: max param abs diff {worst:.1e}")
        if bitwise:
            assert after.case(name)["losses"] == during.case(name)["losses"], label
            assert worst == 0.0, label
        else:
            assert worst <= 1e-6, label
