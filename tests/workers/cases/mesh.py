"""Case ``mesh`` (one per launch): the mesh of a layout, built over gloo with a collective timeout, reporting each
group's timeout (tests/test_device_hygiene.py).

    run.py mesh --opts '{"degrees": "dp=2,tp=2", "timeout": 77}' --out DIR

Its result: the timeout (seconds) of every axis group and of every role (flattened where it spans two
sized axes), and the world's. The groups get the timeout after they are built (``ParallelMesh``), on every
backend they have.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lightning_parallel._compat import group_timeout
from lightning_parallel.parallel.mesh import MESH_AXES, ROLES, ParallelDims

PROCESS_GROUP = True


def run_case(case: dict, ctx) -> dict:
    degrees = {k: int(v) for k, v in (item.split("=") for item in case["degrees"].split(","))}
    dims = ParallelDims.from_degrees(world_size=ctx.world, **degrees)
    mesh = dims.build_mesh("cpu", timeout=timedelta(seconds=float(case["timeout"])))
    names = [*MESH_AXES, *ROLES]
    result = {name: group_timeout(mesh.group(name)).total_seconds() for name in names}
    result["world"] = group_timeout(dist.group.WORLD).total_seconds()
    return result
