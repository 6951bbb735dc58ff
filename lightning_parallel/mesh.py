"""One named device mesh for every parallelism: axes ``pp``, ``dp``, ``tp`` in that order.

The order puts tensor parallelism on neighbouring ranks (the fastest links on a node) and pipeline
stages on the outermost axis, as Megatron and torchtitan do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh

PP = "pp"
DP = "dp"
TP = "tp"
MESH_AXES = (PP, DP, TP)


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
        """Validate ``pp * dp * tp == world_size``; ``dp="auto"`` takes the ranks that pp and tp leave.

        Raises:
            ValueError: with the arithmetic and the fix, when the degrees do not fit the world size.
        """
        world_size = check_degree("world_size", world_size)
        pp = check_degree("pp", pp)
        tp = check_degree("tp", tp)
        if dp == "auto":
            if world_size % (pp * tp) != 0:
                raise ValueError(
                    f"dp='auto' needs world_size({world_size}) divisible by pp({pp}) * tp({tp}) = {pp * tp}: "
                    f"choose pp and tp whose product divides {world_size}, or change the number of devices."
                )
            dp = world_size // (pp * tp)
        dp = check_degree("dp", dp)
        if pp * dp * tp != world_size:
            raise ValueError(
                f"pp({pp}) * dp({dp}) * tp({tp}) = {pp * dp * tp} != world_size({world_size}): "
                f"set the degrees so their product is {world_size}, or use dp='auto'."
            )
        return cls(pp=pp, dp=dp, tp=tp, world_size=world_size)

    @property
    def degrees(self) -> dict[str, int]:
        return {PP: self.pp, DP: self.dp, TP: self.tp}

    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
        """The 3D mesh over the default process group; size-1 axes are kept so code can always name them.
        ``timeout`` bounds the axis groups' collectives (torch gives new groups its 30-minute default, not the
        world's timeout)."""
        from torch._C._distributed_c10d import Backend  # the C++ one: its Options carry a timeout
        from torch.distributed.device_mesh import init_device_mesh

        override = None
        if timeout is not None:
            override = {axis: Backend.Options("", timeout) for axis in MESH_AXES}
        shape = (self.pp, self.dp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES, backend_override=override)

    def __str__(self) -> str:
        return f"pp={self.pp} dp={self.dp} tp={self.tp} (world_size={self.world_size})"
