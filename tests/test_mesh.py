"""ParallelDims: degrees checked against the world size, with the arithmetic in the error."""

from __future__ import annotations

import pytest

from lightning_parallel.parallel.mesh import ParallelDims


def splits(world: int) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) whose product is ``world``."""
    return [
        (pp, dp, world // (pp * dp))
        for pp in range(1, world + 1)
        for dp in range(1, world + 1)
        if world % (pp * dp) == 0
    ]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_split_is_accepted(world):
    for pp, dp, tp in splits(world):
        dims = ParallelDims.from_degrees(world, pp=pp, dp=dp, tp=tp)
        assert (dims.pp, dims.dp, dims.tp) == (pp, dp, tp)
        assert ParallelDims.from_degrees(world, pp=pp, tp=tp).dp == dp  # dp="auto"


def test_product_mismatch_shows_the_arithmetic():
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(3\) \* tp\(2\) = 12 != world_size\(8\)"):
        ParallelDims.from_degrees(8, pp=2, dp=3, tp=2)


def test_auto_dp_needs_divisible_world():
    with pytest.raises(ValueError, match=r"dp='auto' needs world_size\(6\) divisible by pp\(4\) \* tp\(1\)"):
        ParallelDims.from_degrees(6, pp=4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_degrees_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="tp="):
        ParallelDims.from_degrees(4, tp=bad)


def test_roles_name_axes_and_sizes():
    from lightning_parallel.parallel.mesh import MESH_AXES, ROLES

    dims = ParallelDims.from_degrees(8, pp=2, tp=2)
    assert all(axis in MESH_AXES for axes in ROLES.values() for axis in axes)
    assert dims.role_size("batch") == dims.role_size("shard") == 2
    assert (dims.role_size("stage"), dims.role_size("tensor")) == (2, 2)
    assert str(dims) == "pp=2 dp=2 tp=2 (world_size=8)"


# Issue 42, item 4: every process group the strategy makes (the world, each axis, each flattened role, HSDP's, a side
# group such as the MoE pipeline's) carries the run's timeout: Lightning's 30-minute default when none is given,
# where torch gives a new NCCL group 10 minutes (the worker gives gloo that default, so a group left to it shows).
@pytest.mark.parametrize(
    "world, spec, timeout, want",
    [
        (2, "hybrid3d:zero_stage=3", None, 1800.0),
        pytest.param(4, "hybrid3d:dp=2,cp=2", 77, 77.0, marks=pytest.mark.slow),
        pytest.param(4, "hybrid3d:dp_shard=2,zero_stage=3", None, 1800.0, marks=pytest.mark.slow),
    ],
)
def test_every_group_takes_the_runs_timeout(tmp_path, world, spec, timeout, want):
    import json

    from harness import run_worker

    opts = json.dumps({"spec": spec, "timeout": timeout})
    for rank in run_worker("group_timeouts", world, ["--opts", opts], tmp_path, timeout=300):
        assert rank["groups"] > 2 and set(rank["timeouts"]) == {want}, rank
