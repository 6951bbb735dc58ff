"""One named device mesh for every parallelism, and the meshes each part of the code asks for by role.

The axes are ``pp``, ``dp``, ``tp``, outermost first: tensor parallelism on neighbouring ranks (the fastest
links on a node), pipeline stages on the outermost axis, as Megatron and torchtitan do. Code never names an
axis to find its ranks; it asks for a role (torchtitan's ``get_mesh("loss")``):

=========  ===========================================================================
role       what it is for
=========  ===========================================================================
batch      ranks that see different samples: the sampler, ``sync_dist``, metrics, BatchNorm
loss       ranks whose losses average into the global loss
shard      ranks a data-parallel sharding (ZeRO 0-3) spreads model states over
stage      pipeline stages: activations sent point to point, tied weights summed
tensor     tensor parallelism
=========  ===========================================================================

Adding an axis: a field of :class:`ParallelDims`, its place in :data:`MESH_AXES`, and the roles it joins in
:data:`ROLES` (a role over several axes of size > 1 is flattened into one mesh). Pure torch.

May import: torch and ``lightning_parallel._compat``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel._compat import C10dBackend

PP = "pp"
DP = "dp"
TP = "tp"
MESH_AXES = (PP, DP, TP)  # outermost first

ROLES: dict[str, tuple[str, ...]] = {
    "batch": (DP,),
    "loss": (DP,),
    "shard": (DP,),
    "stage": (PP,),
    "tensor": (TP,),
}


def check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a parallel degree: set {name} to a positive integer.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees whose product is the world size.

    Build it with :meth:`from_degrees`, which resolves ``dp="auto"`` and checks the arithmetic before any
    process group exists.
    """

    pp: int
    dp: int
    tp: int
    world_size: int

    @classmethod
    def from_degrees(
        cls,
        world_size: int,
        *,
        pp: int = 1,
        dp: int | Literal["auto"] = "auto",
        tp: int = 1,
    ) -> ParallelDims:
        """Validate ``pp * dp * tp == world_size``; ``dp="auto"`` takes the ranks the other axes leave.

        Raises:
            ValueError: with the arithmetic and the fix, when the degrees do not fit the world size.
        """
        world_size = check_degree("world_size", world_size)
        given = {PP: check_degree("pp", pp), TP: check_degree("tp", tp)}
        others = " * ".join(f"{axis}({d})" for axis, d in given.items())
        product = _product(given.values())
        if dp == "auto":
            if world_size % product != 0:
                raise ValueError(
                    f"dp='auto' needs world_size({world_size}) divisible by {others} = {product}: "
                    f"choose {' and '.join(given)} whose product divides {world_size}, or change the number of devices."
                )
            dp = world_size // product
        dp = check_degree("dp", dp)
        degrees = {PP: given[PP], DP: dp, TP: given[TP]}
        if _product(degrees.values()) != world_size:
            terms = " * ".join(f"{axis}({d})" for axis, d in degrees.items())
            raise ValueError(
                f"{terms} = {_product(degrees.values())} != world_size({world_size}): "
                f"set the degrees so their product is {world_size}, or use dp='auto'."
            )
        return cls(world_size=world_size, **degrees)

    @property
    def degrees(self) -> dict[str, int]:
        """Every axis and its degree, outermost first."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def role_size(self, role: str) -> int:
        return _product(getattr(self, axis) for axis in ROLES[role])

    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> ParallelMesh:
        """The mesh over the default process group; size-1 axes are kept so code can always name them.
        ``timeout`` bounds the axis groups' collectives (torch gives new groups its 30-minute default, not the
        world's timeout)."""
        override = None
        if timeout is not None:
            override = {axis: C10dBackend.Options("", timeout) for axis in MESH_AXES}
        shape = tuple(self.degrees.values())
        return ParallelMesh(
            self, init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES, backend_override=override)
        )

    def __str__(self) -> str:
        return " ".join(f"{axis}={d}" for axis, d in self.degrees.items()) + f" (world_size={self.world_size})"


class ParallelMesh:
    """The world's mesh, handing out 1-D meshes and process groups by role (or by axis name).

    Args:
        dims: the degrees the mesh was built from.
        device_mesh: torch's mesh with one named dimension per axis of :data:`MESH_AXES`.
    """

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh) -> None:
        self.dims = dims
        self.device_mesh = device_mesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a role (``"batch"``, ``"shard"``, ...) or of an axis (``"pp"``, ``"dp"``, ``"tp"``)."""
        axes = ROLES.get(name, (name,))
        if any(axis not in MESH_AXES for axis in axes):
            raise KeyError(f"{name!r} is neither a mesh role ({', '.join(ROLES)}) nor an axis ({', '.join(MESH_AXES)})")
        if len(axes) == 1:
            return self.device_mesh[axes[0]]
        raise NotImplementedError(f"role {name!r} spans {axes}: flatten them with DeviceMesh._flatten in _compat")

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def rank(self, name: str) -> int:
        """This rank's index along a role or axis."""
        return self[name].get_local_rank()

    def size(self, name: str) -> int:
        return self[name].size()

    def axis_groups(self) -> dict[str, dist.ProcessGroup]:
        """The process group of every axis, by axis name (what gradient-norm code reduces over)."""
        return {axis: self.group(axis) for axis in MESH_AXES}


def axis_combinations() -> list[tuple[str, ...]]:
    """Every non-empty set of axes, sorted: a collective issued over each keeps every rank in step."""
    return [c for n in range(1, len(MESH_AXES) + 1) for c in itertools.combinations(sorted(MESH_AXES), n)]


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


assert [f.name for f in fields(ParallelDims)][:-1] == list(MESH_AXES), "one field per axis, in mesh order"
