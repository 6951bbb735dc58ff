"""The mesh of a layout, built over gloo with a collective timeout, reporting each group's timeout.

    mesh_worker.py --degrees dp=2,tp=2 --timeout 77 --out DIR

Writes ``rank<N>.json``: the timeout (seconds) of every axis group and of every role (flattened where it spans two
sized axes), and the world's. The groups get the timeout after they are built (``ParallelMesh``), on every
backend they have.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lightning_parallel._compat import group_timeout
from lightning_parallel.parallel.mesh import MESH_AXES, ROLES, ParallelDims


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--degrees", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    degrees = {k: int(v) for k, v in (item.split("=") for item in args.degrees.split(","))}
    dims = ParallelDims.from_degrees(world_size=dist.get_world_size(), **degrees)
    mesh = dims.build_mesh("cpu", timeout=timedelta(seconds=args.timeout))
    names = [*MESH_AXES, *ROLES]
    result = {name: group_timeout(mesh.group(name)).total_seconds() for name in names}
    result["world"] = group_timeout(dist.group.WORLD).total_seconds()
    (args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
