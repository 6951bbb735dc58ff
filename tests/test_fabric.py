"""The mesh strategies under Lightning Fabric: a Fabric loop (10 AdamW steps, clipped and accumulated, fp32) under
each strategy against the same loop in one process, losses within 1e-5 and parameters within PARAM_ATOL; the
names in Fabric's registry; the refusals, before any process starts."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import Batch
from lightning.fabric.plugins.precision import MixedPrecision
from parity import assert_same_losses, assert_same_params

import lightning_parallel  # noqa: F401  (registers the names)
from lightning_parallel import Hybrid3DFabricStrategy, ZeroFabricStrategy
from lightning_parallel.parallel.loss_scaler import LossScaler

CASES = [
    {"name": "plain", "steps": 10},
    {"name": "clip_accumulate", "steps": 10, "clip": 0.05, "accumulate": 2},
]
META = [{**case, "meta": True} for case in CASES]  # built under fabric.init_module(empty_init=True)
SEPARATELY = [META[0], {**META[1], "separately": True}]  # setup_module, then setup_optimizers

FAST = {
    "reference": (1, "auto", CASES),
    "zero2": (2, "zero2", CASES),
    "zero3": (2, "zero3", SEPARATELY),
    "tp2": (2, "hybrid3d:tp=2", [*META, {"name": "no_plan", "expect_error": True}]),
    "dp2": (2, "hybrid3d", CASES),  # ZeRO-0: the data-parallel all-reduce is the strategy's alone (once per step)
}


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> Batch:
    return Batch(tmp_path_factory, FAST, tag="fabric", worker="fabric")


@pytest.mark.parametrize("label", ["zero2", "zero3", "tp2", "dp2"])
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_fabric_loop_matches_one_process(fast, label, case):
    run, ref = fast[label], fast["reference"]
    assert_same_losses(run.losses(case), ref.losses(case), f"fabric {label} {case}")
    assert_same_params(run.params(case), ref.params(case), f"fabric {label} {case}")
    # fabric.all_reduce averages over the data-parallel ranks (the loss role): the global loss on every rank
    for rank in range(len(run.ranks)):
        assert_same_losses(run.case(case, rank)["reduced"], run.losses(case), f"fabric {label} all_reduce")
        assert run.case(case, rank)["broadcast"] == 10 * (len(run.ranks) - 1) + 7  # from the last rank
        assert run.case(case, rank)["device"] == "cpu"


def test_model_refused_as_under_the_trainer(fast):
    """The Trainer's model checks (strategies/checks.py) run at fabric.setup, on every rank alike, before any
    collective: a model without a tensor-parallel plan under tp=2 is refused with the Trainer's message."""
    for rank in range(2):
        error = fast["tp2"].case("no_plan", rank)["error"]
        assert error.startswith("TypeError") and "tensor_parallel_plan" in error, error


def test_names_in_fabrics_registry():
    for name, cls, settings in [
        ("zero1", ZeroFabricStrategy, {"zero_stage": 1}),
        ("zero2", ZeroFabricStrategy, {"zero_stage": 2}),
        ("zero3", ZeroFabricStrategy, {"zero_stage": 3}),
        ("zero3_offload", ZeroFabricStrategy, {"zero_stage": 3, "offload": True}),
        ("hybrid3d", Hybrid3DFabricStrategy, {}),
    ]:
        strategy = L.Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert type(strategy) is cls
        assert all(getattr(strategy.config, k) == v for k, v in settings.items()), name


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ZeroFabricStrategy(stage=2, tp=2), "ZeroFabricStrategy does not take tp"),
        (lambda: ZeroFabricStrategy(stage=4), "stage"),
        (lambda: Hybrid3DFabricStrategy(pp=2, pp_schedule="bogus"), "pp_schedule"),
        (lambda: Hybrid3DFabricStrategy(overlap_grad_reduce=True), "overlap_grad_reduce"),
        (lambda: Hybrid3DFabricStrategy(bogus=1), "unknown setting"),
    ],
)
def test_bad_settings_refused_at_construction(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_bad_degrees_refused_before_launch():
    with pytest.raises(ValueError, match="tp"):
        L.Fabric(accelerator="cpu", devices=2, strategy=Hybrid3DFabricStrategy(tp=4))
    with pytest.raises(ValueError, match="world size is 1"):
        L.Fabric(accelerator="cpu", devices=1, strategy="zero2")


def test_fp16_gets_the_mesh_wide_loss_scaler():
    """16-mixed in Fabric: torch's GradScaler (one verdict per rank, no DTensor gradients) is swapped for the
    Trainer's LossScaler with its settings (the runs: tests/test_fabric_pipeline.py's fp16 cases)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    strategy = ZeroFabricStrategy(stage=2, precision=MixedPrecision("16-mixed", device="cpu", scaler=scaler))
    assert isinstance(strategy.precision.scaler, LossScaler)
    assert (
        strategy.precision.scaler.get_scale() == 1024.0
        and strategy.precision.scaler.state_dict()["growth_interval"] == 7
    )
