"""One named device mesh for every parallelism, and the meshes each part of the code asks for by role.

The axes are ``pp``, ``dpr``, ``dp``, ``ep``, ``cp``, ``tp``, outermost first: tensor parallelism on neighbouring
ranks (the fastest links on a node), pipeline stages on the outermost axis, as Megatron and torchtitan do. Expert
parallelism is carved out of the data-parallel ranks (torchtitan, Megatron-Core): with ``dp=D`` and ``ep=E`` the
mesh's ``dp`` axis has D/E ranks (those that hold the same experts) and its ``ep`` axis E; data parallelism spans
both. Context parallelism (``cp``) splits each sample's sequence: its ranks see the same samples (not in ``batch``),
average their losses and gradients (in ``loss`` and ``shard``, torchtitan's FSDP over dp x cp). Spatial parallelism
(``spatial``: each image split into strips of rows, for conv nets) shares the ``cp`` axis, the axis that splits each
sample along a non-batch dimension: with ``spatial=S`` the ``cp`` axis has S ranks (cp and spatial are never both
above 1), so its ranks read the same samples, ZeRO shards over dp x spatial and losses average over dp x spatial,
exactly as for cp; ``ParallelDims.spatial`` says which of the two the axis holds. HSDP (``dp_shard``)
splits the data-parallel ranks into replicas x shards: ``dpr`` (torchtitan's dp_replicate: dp / dp_shard replicas,
outermost, so each replica's shards are neighbouring ranks, inside a node) and the ``dp`` axis (dp_shard / ep
ranks). ZeRO shards over ``shard`` and all-reduces the shards over ``replicate``. Code never names an axis to find
its ranks; it asks for a role (torchtitan's ``get_mesh("loss")``):

============  ===========================================================================
role          what it is for
============  ===========================================================================
batch         ranks that see different samples: the sampler, metrics, BatchNorm
loss          ranks whose losses average into the global loss: ``sync_dist``
shard         ranks a data-parallel sharding (ZeRO 0-3) spreads model states over
replicate     HSDP: ranks holding the same shard (one per replica), whose sharded gradients are all-reduced
expert        expert parallelism: ranks holding different experts, exchanging tokens by all-to-all
expert_shard  ranks holding the same experts: their gradients meet and ZeRO shards them there
context       context or spatial parallelism: ranks holding pieces of the same samples (sequences or images)
stage         pipeline stages: activations sent point to point, tied weights summed
tensor        tensor parallelism
============  ===========================================================================

Adding an axis: a constant, its place in :data:`MESH_AXES`, the roles it joins in :data:`ROLES` (a role over several
axes of size > 1 is flattened into one mesh named ``"dp_ep"``, its axes joined by ``_``) and a field of
:class:`ParallelDims` named as the axis. An axis whose size is its setting (:data:`PLAIN_AXES`, as pp and tp) needs
nothing more here: the world-size arithmetic, :attr:`ParallelDims.degrees`, its ``str`` and
:meth:`~lightning_parallel.parallel.config.ParallelConfig.dims` read every axis from these tables. Pure torch.

May import: torch and ``lightning_parallel._compat``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel._compat import flatten_mesh, group_timeout, set_group_timeout

PP = "pp"
DPR = "dpr"  # HSDP's replicas (dp / dp_shard); no "_" in axis names: flattened roles join axes with it
DP = "dp"
EP = "ep"
CP = "cp"
TP = "tp"
MESH_AXES = (PP, DPR, DP, EP, CP, TP)  # outermost first
DERIVED_AXES = (DPR, DP, EP, CP)  # sizes worked out from dp, ep, dp_shard, cp and spatial (ParallelDims.from_degrees)
PLAIN_AXES = tuple(a for a in MESH_AXES if a not in DERIVED_AXES)  # the axis's size is its setting, named alike
ALWAYS_SHOWN = (PP, TP)  # named in the arithmetic of every layout; other plain axes only above 1

ROLES: dict[str, tuple[str, ...]] = {
    "batch": (DPR, DP, EP),
    "loss": (DPR, DP, EP, CP),
    "shard": (DP, EP, CP),
    "replicate": (DPR,),
    "expert": (EP,),
    "expert_shard": (DPR, DP),
    "context": (CP,),
    "stage": (PP,),
    "tensor": (TP,),
}


def check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a parallel degree: set {name} to a positive integer.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees whose product (with ``dp`` counting the expert-parallel ranks too) is the world size.

    Build it with :meth:`from_degrees`, which resolves ``dp="auto"`` and checks the arithmetic before any
    process group exists. ``dp`` is the data-parallel degree; ``ep`` divides it (the mesh's ``dp`` axis is dp/ep).
    """

    pp: int
    dp: int
    tp: int
    world_size: int
    ep: int = 1
    cp: int = 1
    dpr: int = 1  # HSDP: data-parallel replicas (dp / dp_shard); each holds the model states sharded over dp_shard
    spatial: int = 1  # the cp axis splits images into strips instead of sequences: 1, or the cp axis's degree

    @classmethod
    def from_degrees(
        cls,
        world_size: int,
        *,
        dp: int | Literal["auto"] = "auto",
        ep: int = 1,
        cp: int = 1,
        dp_shard: int | None = None,
        spatial: int = 1,
        **plain: int,
    ) -> ParallelDims:
        """Validate ``pp * dp * cp * tp == world_size`` (times every other axis of :data:`PLAIN_AXES`);
        ``dp="auto"`` takes the ranks the other axes leave; ``dp_shard`` (HSDP: None shards over all of dp) splits
        dp into dp / dp_shard replicas; ``spatial`` (strips of images) takes the cp axis, and cp stays 1. Only the
        arithmetic: what the settings allow together (ep and dp_shard dividing dp, spatial beside cp, ...) is
        :class:`~lightning_parallel.parallel.config.ParallelConfig`'s to check (``ParallelConfig.dims``).

        Args:
            world_size: the number of processes.
            dp: the data-parallel degree, or ``"auto"``.
            ep: the expert-parallel degree (carved out of dp).
            cp: the context-parallel degree.
            dp_shard: HSDP's shard group inside dp (None: all of dp).
            spatial: the spatial degree (it takes the cp axis).
            **plain: the degree of each axis of :data:`PLAIN_AXES` (``pp``, ``tp``, ...) by its name; default 1.

        Raises:
            ValueError: with the arithmetic and the fix, when the degrees do not fit the world size.
            TypeError: a keyword that is no axis.
        """
        unknown = sorted(set(plain) - set(PLAIN_AXES))
        if unknown:
            axes = ", ".join(PLAIN_AXES)
            raise TypeError(f"from_degrees() got {', '.join(unknown)}: not an axis of PLAIN_AXES ({axes})")
        world_size = check_degree("world_size", world_size)
        sizes = {axis: check_degree(axis, plain.get(axis, 1)) for axis in PLAIN_AXES}
        check_degree("cp", cp)
        assert check_degree("spatial", spatial) == 1 or cp == 1, "ParallelConfig refuses spatial with cp"
        split = "spatial" if spatial > 1 else CP  # the cp axis, named as the user set it
        cp = max(cp, spatial)
        # in mesh order with cp in its place, tp last; axes of size 1 not named unless always shown
        given = {a: sizes[a] for a in PLAIN_AXES if a != TP and (a in ALWAYS_SHOWN or sizes[a] > 1)}
        given |= ({split: cp} if cp > 1 else {}) | {TP: sizes[TP]}
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
        outer = MESH_AXES.index(DPR)  # dp goes where the data-parallel axes sit in the mesh
        degrees = {a: d for a, d in given.items() if a in MESH_AXES[:outer]} | {DP: dp}
        degrees |= {a: d for a, d in given.items() if a not in degrees}
        if _product(degrees.values()) != world_size:
            terms = " * ".join(f"{axis}({d})" for axis, d in degrees.items())
            raise ValueError(
                f"{terms} = {_product(degrees.values())} != world_size({world_size}): "
                f"set the degrees so their product is {world_size}, or use dp='auto'."
            )
        ep = check_degree("ep", ep)
        dp_shard = dp if dp_shard is None else check_degree("dp_shard", dp_shard)
        assert dp % ep == 0 and dp % dp_shard == 0, "ParallelConfig.dims checks that ep and dp_shard divide dp"
        dpr = dp // dp_shard
        return cls(world_size=world_size, ep=ep, dp=dp, cp=cp, dpr=dpr, spatial=spatial, **sizes)

    @classmethod
    def of(
        cls,
        *,
        dp: int | None = None,
        ep: int = 1,
        cp: int = 1,
        dp_shard: int | None = None,
        spatial: int = 1,
        **plain: int,
    ) -> ParallelDims:
        """The degrees given, on as many processes as they take (their product): a layout to check a model against
        without a world size (``ParallelDims.of(tp=2, cp=2)``); ``dp`` defaults to ``ep``'s ranks."""
        dp = ep if dp is None else dp
        world_size = dp * max(cp, spatial) * _product(plain.values())
        return cls.from_degrees(world_size, dp=dp, ep=ep, cp=cp, dp_shard=dp_shard, spatial=spatial, **plain)

    @property
    def degrees(self) -> dict[str, int]:
        """Every mesh axis and its size, outermost first (``dpr``: HSDP's replicas; ``dp``: the ranks of one replica
        holding the same experts, dp / dpr / ep)."""
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        return sizes | {DP: self.dp // (self.ep * self.dpr)}

    @property
    def context(self) -> int:
        """The context-parallel degree: the cp axis's size when it splits sequences, 1 when it holds image strips."""
        return self.cp if self.spatial == 1 else 1

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks one replica's shards span (all of dp without HSDP)."""
        return self.dp // self.dpr

    def node_local(self) -> dict[str, int]:
        """The axes that should stay inside a node, by the degree they take there: tp and cp or spatial
        (activations cross them every layer) and, under HSDP, dp_shard (parameters gathered every step; only
        replicas cross nodes)."""
        local = {TP: self.tp, ("spatial" if self.spatial > 1 else CP): self.cp}
        if self.dpr > 1:
            local["dp_shard"] = self.dp_shard
        return {axis: d for axis, d in local.items() if d > 1}

    def check_node_size(self, node_size: int, num_nodes: int) -> None:
        """Across several nodes, the node-local axes (:meth:`node_local`) must tile each node: their product divides
        the processes per node, so the mesh (innermost axes on neighbouring ranks) keeps them inside one.

        Raises:
            ValueError: with the node size, the product and the fix.
        """
        local = self.node_local()
        product = _product(local.values())
        if num_nodes < 2 or not local or node_size % product == 0:
            return
        terms = " * ".join(f"{axis}({d})" for axis, d in local.items())
        raise ValueError(
            f"{terms} = {product} does not divide the node size {node_size} (processes per node, torchrun's "
            f"--nproc-per-node / Trainer devices) over {num_nodes} nodes: these axes would cross nodes. Choose "
            f"degrees whose product divides {node_size}, or change the processes per node."
        )

    def role_size(self, role: str) -> int:
        return _product(self.degrees[axis] for axis in ROLES[role])

    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> ParallelMesh:
        """The mesh over the default process group; size-1 axes are kept so code can always name them.
        ``timeout`` bounds the axis groups' collectives (None: the default group's): torch gives a new group its
        backend's default, not the world's timeout (30 minutes on gloo, 10 on NCCL, where Lightning's default is
        30). It is set on each group once built, on every backend it has: backend options passed at creation are
        per backend (NCCL's split refuses generic ones), a timeout set afterwards is not."""
        shape = tuple(self.degrees.values())
        return ParallelMesh(self, init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES), timeout=timeout)

    def __str__(self) -> str:
        shown = {PP: self.pp, DP: self.dp, TP: self.tp} | ({EP: self.ep} if self.ep > 1 else {})
        shown |= {("spatial" if self.spatial > 1 else CP): self.cp} if self.cp > 1 else {}
        shown |= {"dp_shard": self.dp_shard} if self.dpr > 1 else {}
        shown |= {a: getattr(self, a) for a in PLAIN_AXES if a not in shown and getattr(self, a) > 1}
        return " ".join(f"{axis}={d}" for axis, d in shown.items()) + f" (world_size={self.world_size})"


class ParallelMesh:
    """The world's mesh, handing out 1-D meshes and process groups by role (or by axis name).

    Args:
        dims: the degrees the mesh was built from.
        device_mesh: torch's mesh with one named dimension per axis of :data:`MESH_AXES`.
    """

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh, timeout: timedelta | None = None) -> None:
        self.dims = dims
        self.device_mesh = device_mesh
        # every group the mesh makes takes the run's timeout: the world's unless told otherwise
        self.timeout = _world_timeout(device_mesh.device_type) if timeout is None else timeout
        self._flat: dict[str, DeviceMesh] = {}
        self._by_name: dict[str, DeviceMesh] = {}  # the 1-D mesh of each role or axis asked for, looked up once
        self._answers: dict[tuple[str, str], Any] = {}
        for axis in MESH_AXES:
            self._set_timeout(device_mesh.get_group(axis))

    def _set_timeout(self, group: dist.ProcessGroup) -> None:
        if self.timeout is not None:
            set_group_timeout(group, self.timeout)

    def side_group(self, ranks: list[int]) -> dist.ProcessGroup:
        """A process group of ``ranks`` beside the mesh's (only they call this: ``use_local_synchronization``), with
        the mesh's timeout (the MoE pipeline's router sums)."""
        group = dist.new_group(ranks, use_local_synchronization=True)
        self._set_timeout(group)
        return group

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a role (``"batch"``, ``"shard"``, ...) or of an axis (``"pp"``, ``"dp"``, ``"tp"``)."""
        found = self._by_name.get(name)
        if found is None:  # torch's mesh slicing costs a thousand Python calls: not on every step's path
            found = self._by_name[name] = self._lookup(name)
        return found

    def _lookup(self, name: str) -> DeviceMesh:
        axes = self.role_axes(name)
        if len(axes) == 1:
            return self.device_mesh[axes[0]]
        flat = "_".join(axes)
        if flat not in self._flat:
            self._flat[flat] = flatten_mesh(self.device_mesh[axes], flat)
            self._set_timeout(self._flat[flat].get_group())
        return self._flat[flat]

    def role_axes(self, name: str) -> tuple[str, ...]:
        """The axes a role spans, size-1 axes left out (at least one kept)."""
        axes = ROLES.get(name, (name,))
        if any(axis not in MESH_AXES for axis in axes):
            raise KeyError(f"{name!r} is neither a mesh role ({', '.join(ROLES)}) nor an axis ({', '.join(MESH_AXES)})")
        sized = tuple(a for a in axes if self.dims.degrees[a] > 1)
        return sized or axes[:1]

    def group(self, name: str) -> dist.ProcessGroup:
        return self._cached("group", name, lambda mesh: mesh.get_group())

    def rank(self, name: str) -> int:
        """This rank's index along a role or axis."""
        return self._cached("rank", name, lambda mesh: mesh.get_local_rank())

    def size(self, name: str) -> int:
        return self._cached("size", name, lambda mesh: mesh.size())

    def _cached(self, what: str, name: str, read: Callable[[DeviceMesh], Any]) -> Any:
        """A role's group, rank or size, read from its mesh once (steps ask for them every time)."""
        key = (what, name)
        if key not in self._answers:
            self._answers[key] = read(self[name])
        return self._answers[key]

    def hsdp_mesh(self) -> DeviceMesh:
        """HSDP's 2-D mesh (``replicate``, ``shard``): FSDP2 reduce-scatters over the second dimension and
        all-reduces over the first (torchtitan's ``dp_replicate, dp_shard_cp``)."""
        shard = self["shard"].mesh_dim_names
        assert shard is not None and self.dims.dpr > 1, "HSDP needs dp_shard < dp"
        return self.device_mesh[(DPR, shard[0])]

    def group_axes(self) -> dict[str, str]:
        """Process group name -> the axes it spans (``"dp"``, ``"dp_cp"``, ``"world"``): how communication counters
        split bytes by axis. A group several axes share (size-1 axes beside it) is named by the sized ones."""
        names = {dist.group.WORLD.group_name: "world"} if dist.group.WORLD is not None else {}
        for axis in reversed(MESH_AXES):  # an axis of size > 1 overwrites a size-1 axis sharing its group
            group = self.device_mesh.get_group(axis)
            if group.group_name not in names or self.dims.degrees[axis] > 1:
                names[group.group_name] = axis
        for flat, mesh in self._flat.items():
            names[mesh.get_group().group_name] = flat
        return names

    def axis_groups(self) -> dict[str, dist.ProcessGroup]:
        """The process group of every axis, by axis name (what gradient-norm code reduces over)."""
        return {axis: self.group(axis) for axis in MESH_AXES}


def _world_timeout(device_type: str) -> timedelta | None:
    """The default group's collective timeout; None where its backend keeps none (torch's fake process group)."""
    try:
        return group_timeout(dist.group.WORLD, device_type)
    except AttributeError:
        return None


def axis_combinations() -> list[tuple[str, ...]]:
    """Every non-empty set of axes, sorted: a collective issued over each keeps every rank in step."""
    return [c for n in range(1, len(MESH_AXES) + 1) for c in itertools.combinations(sorted(MESH_AXES), n)]


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


# one field per axis; ``spatial`` says what the cp axis splits
assert {f.name for f in fields(ParallelDims)} == {*MESH_AXES, "world_size", "spatial"}, "one field per axis"
