"""MuonAdamW with torch's bf16 Newton-Schulz (ns_dtype=bfloat16, fp32 training, 10 steps): its bar comes from one
process's own summation-order noise, measured here, not from a constant. One process trains the same 16 samples per
step once as one batch and once as 2 accumulated micro-batches of 8 (the gradient summed in another order, as dp=2
sums it); bf16's rounding of the orthogonalized update turns that last-bit difference into a visible one. A layout
passes when it stays within BAR_FACTOR times that noise of the one-batch run (losses relative, parameters absolute)."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_losses, assert_same_params

BF16 = {"steps": 10, "optimizer": "muon_bf16"}
REFERENCE = [{**BF16, "name": "plain"}, {**BF16, "name": "accumulate", "accumulate": 2}]
LAYOUTS = {"zero3": (2, "zero3", [0, 1]), "tp2": (2, "hybrid3d:tp=2", [0])}  # label -> (world, strategy, loss ranks)
BAR_FACTOR = 3  # a layout's rounding differs from the one-process pair's: the same order of noise, not the same draw


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    table = {label: (world, spec, [{**BF16, "name": "plain"}]) for label, (world, spec, _) in LAYOUTS.items()}
    table["reference"] = (1, "auto", REFERENCE)
    return Batch(tmp_path_factory, table, tag="muon_bf16")


def noise(runs: Batch) -> tuple[float, float]:
    """One process's summation-order noise: (largest relative loss difference, largest absolute parameter
    difference) between the one-batch and the accumulated run."""
    reference = runs["reference"]
    micro = reference.losses("accumulate")  # 2 micro-batches of 8 per step: their mean is the step's loss
    steps = [(a + b) / 2 for a, b in zip(micro[::2], micro[1::2])]
    loss = assert_same_losses(steps, reference.losses("plain"), "noise", rtol=1.0)
    param = assert_same_params(reference.params("accumulate"), reference.params("plain"), "noise", atol=1.0)
    return loss, param


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_muon_bf16_within_one_process_noise(runs, label):
    loss_noise, param_noise = noise(runs)
    plain = runs["reference"].params("plain")
    scale = max(p.abs().max().item() for p in plain.values())
    print(f"bf16 Newton-Schulz, one process: loss noise {loss_noise:.1e} relative, parameter noise {param_noise:.1e} "
          f"absolute ({param_noise / scale:.1e} of the largest parameter)")  # fmt: skip
    assert param_noise > 0  # the noise is real: a bar of 0 would ask bf16 to be exact
    world, _, leaders = LAYOUTS[label]
    reference = runs["reference"]
    rel = assert_same_losses(runs[label].losses("plain", leaders), reference.losses("plain"), label,
                             rtol=BAR_FACTOR * max(loss_noise, 1e-7))  # fmt: skip
    diff = assert_same_params(runs[label].params("plain"), plain, label, atol=BAR_FACTOR * param_noise)
    print(f"muon bf16 {label}: loss rel diff {rel:.1e}, param abs diff {diff:.1e} (bars x{BAR_FACTOR} the noise)")
