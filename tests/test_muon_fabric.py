"""MuonAdamW in a Fabric loop (tests/workers/cases/fabric.py, optimizer="muon"): zero3 and tp=2 at world 2 train as
one process does (fp32, ns_dtype=float32, 10 steps, clipped: losses within 1e-5 relative, parameters within 1e-5),
and precision="16-mixed" is refused by name when fabric.setup takes the optimizer."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_losses, assert_same_params

CASE = {"name": "clip", "steps": 10, "clip": 0.05, "optimizer": "muon"}
LAYOUTS = {"zero3": (2, "zero3", [0, 1]), "tp2": (2, "hybrid3d:tp=2", [0])}  # label -> (world, strategy, loss ranks)
FP16 = {"name": "fp16", "steps": 1, "optimizer": "muon", "precision": "16-mixed", "refused": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    table = {label: (world, spec, [CASE]) for label, (world, spec, _) in LAYOUTS.items()}
    table["reference"] = (1, "auto", [CASE])
    table["fp16"] = (2, "zero3", [FP16])
    return Batch(tmp_path_factory, table, tag="muon_fabric", worker="fabric")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_muon_in_a_fabric_loop(runs, label):
    _, _, leaders = LAYOUTS[label]
    reference = runs["reference"]
    rel = assert_same_losses(runs[label].losses("clip", leaders), reference.losses("clip"), f"fabric muon {label}")
    diff = assert_same_params(runs[label].params("clip"), reference.params("clip"), f"fabric muon {label}")
    print(f"fabric muon {label}: max loss rel diff {rel:.1e}, max param abs diff {diff:.1e}")


@pytest.mark.slow
def test_fabric_refuses_muon_with_fp16_by_name(runs):
    for rank in range(2):
        error = runs["fp16"].case("fp16", rank).get("error", "")
        assert error.startswith("ValueError") and "MuonAdamW with precision='16-mixed'" in error, error
