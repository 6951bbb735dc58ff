"""hybrid3d: every (dp, tp) split trains exactly like one process on the same global batch."""

from __future__ import annotations

import pytest
from conftest import PARITY_CASES, launch
from parity import assert_same_losses, assert_same_params


def spec(dp: int, tp: int, zero: int, sp: bool = False) -> str:
    return f"hybrid3d:dp={dp},tp={tp},zero_stage={zero}" + (",sequence_parallel=1" if sp else "")


def check_against_reference(run, reference, world: int, tp: int, label: str) -> None:
    dp_leaders = list(range(0, world, tp))  # one rank per dp index (tp is the innermost mesh axis)
    for case in PARITY_CASES:
        name = case["name"]
        for rank in range(world):  # every tp rank of a dp index reports the same loss
            leader = rank - rank % tp
            assert run.case(name, rank)["losses"] == run.case(name, leader)["losses"], f"{label} rank {rank}"
        loss_rel = assert_same_losses(run.losses(name, dp_leaders), reference.losses(name), f"{label} {name}")
        param_abs = assert_same_params(run.params(name), reference.params(name), f"{label} {name}")
        print(f"{label} {name}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    for rank in range(world):
        got_val = run.case("plain", rank)["val_loss"]
        assert abs(got_val - want_val) <= 1e-5 * want_val, f"{label} rank {rank} val_loss {got_val} != {want_val}"


LAYOUTS = [  # (world, dp, tp, zero_stage, sequence_parallel)
    (2, 1, 2, 0, False),
    (4, 2, 2, 0, False),
    (4, 2, 2, 1, False),
    (4, 2, 2, 2, False),
    (4, 2, 2, 3, False),
    (4, 1, 4, 0, False),
    (4, 4, 1, 0, False),
    (4, 2, 2, 1, True),
]
WORLD8 = [(8, dp, 8 // dp, zero, False) for dp in (1, 2, 4, 8) for zero in (0, 1, 3)] + [(8, 2, 4, 2, True)]


def _id(layout) -> str:
    world, dp, tp, zero, sp = layout
    return f"w{world}-dp{dp}-tp{tp}-zero{zero}" + ("-sp" if sp else "")


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_dp_tp_parity(layout, reference, tmp_path_factory):
    world, dp, tp, zero, sp = layout
    run = launch(tmp_path_factory, spec(dp, tp, zero, sp), world, PARITY_CASES)
    check_against_reference(run, reference, world, tp, _id(layout))


@pytest.mark.slow
@pytest.mark.parametrize("layout", WORLD8, ids=_id)
def test_dp_tp_parity_world8(layout, reference, tmp_path_factory):
    world, dp, tp, zero, sp = layout
    run = launch(tmp_path_factory, spec(dp, tp, zero, sp), world, PARITY_CASES)
    check_against_reference(run, reference, world, tp, _id(layout))
