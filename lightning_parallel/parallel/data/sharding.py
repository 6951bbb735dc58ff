"""The interface every data-parallel sharding implements, and the registry of shardings by name. Pure torch.

A sharding is told the mesh it shards over (the mesh's ``shard`` role) and is asked, in this order, to shard
the model (ZeRO-3 wraps it in FSDP2 units; the others leave it), to shard each optimizer, to reduce the
gradients after the last backward of a step, to hand its local gradient pieces to clipping, and to clean up
after the step. Its class attributes are the ZeRO paper's formulas, so the planner, the profiler and the
memory report compute one quantity one way.

HSDP is a property of the mesh, not a class: every sharding gets the 2-D (replicate, shard) mesh when the mesh has
replicas (``hsdp_mesh``), divides by every data-parallel rank (:attr:`DataParallelSharding.data_parallel_size`), and
all-reduces its reduced shard over the replicas (:attr:`DataParallelSharding.replicate_group`).

Adding a variant (ZeRO-3 with a quantized all-gather, ZeRO-2 with fp32 master weights, ...): a subclass in a module
of its own beside these, decorated ``@register_sharding("name")``, imported by
:mod:`lightning_parallel.parallel.data.stages`; ``ParallelConfig(sharding="name")`` selects it. Checkpoints read
what it holds through one method, :meth:`DataParallelSharding.state_view`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.parallel.data.compression import wire_dtype
from lightning_parallel.parallel.data.powersgd import PowerSGD
from lightning_parallel.parallel.dtensor import local, split_axes
from lightning_parallel.parallel.mesh import ParallelMesh
from lightning_parallel.parallel.optim.muon import is_muon

# A local gradient, its parameter, and the mesh axes that split the gradient (each element counted once
# when partial norms are summed over exactly those axes).
GradPiece = tuple[Tensor, nn.Parameter, tuple[str, ...]]

MODEL_STATES = ("params", "grads", "optimizer")

# Optimizers whose update is elementwise, so running them on a flat slice is the same math as
# running them per parameter. Anything else (LBFGS, factored or matrix optimizers) would be wrong.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def check_shardable_optimizer(optimizer: torch.optim.Optimizer, setting: str) -> None:
    """Refuse optimizers whose math changes when the parameters are split. MuonAdamW is the one matrix optimizer
    allowed: it gathers each whole matrix itself (parallel/optim/muon_exchange.py; ZeRO-1/2 tell it their layout).

    Raises:
        TypeError: naming the optimizer, the setting and the optimizers that work.
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS and not is_muon(optimizer):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"{setting} cannot shard {type(optimizer).__name__}: its update is not elementwise, so it would "
            f"compute something else on a slice of the parameters. Return one of {names} from "
            f"configure_optimizers, or use strategy='ddp'."
        )
    if optimizer.state:
        raise ValueError(
            f"{setting} got an optimizer that already has state (it was stepped before the strategy set it "
            "up): create it fresh in configure_optimizers and load states through ckpt_path."
        )


def trainable(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


@dataclass
class FlatSlice:
    """A flat buffer of packed parameters as a checkpoint sees it: this rank holds elements ``[start, end)``, and
    the optimizer keys that slice's state by ``key``."""

    params: list[nn.Parameter]  # the parameters packed in the buffer, in order
    offsets: list[int]  # where each one's (local, flattened) elements start in the buffer
    start: int
    end: int
    key: Tensor  # the optimizer's parameter standing for this slice (its state: optimizer.state[key])
    buffer: Tensor  # the whole buffer, every rank's slice (a template: its size, dtype and device)
    group: torch.distributed.ProcessGroup | None  # the ranks holding the other slices

    def views(self, flat: Tensor) -> Iterator[tuple[nn.Parameter, Tensor]]:
        """Each parameter's elements in a buffer shaped like :attr:`buffer`, shaped like its local tensor."""
        for p, off in zip(self.params, self.offsets):
            shard = local(p)
            yield p, flat[off : off + shard.numel()].view(shard.shape)


@dataclass
class StateView:
    """How a sharding holds one optimizer's state, for checkpoints to read and fill (:meth:`~DataParallelSharding.
    state_view`): the optimizer steps flat slices, not the model's parameters."""

    optimizer: Optimizer  # the optimizer whose ``state`` holds the slices' state
    param_groups: list[list[nn.Parameter]]  # the model parameters of each group, as configure_optimizers built them
    slices: list[list[FlatSlice]]  # per group, the flat buffers its state is held in
    reload: Callable[[], None] = field(default=lambda: None)  # after loading into the slices in place


SHARDINGS: dict[str, type[DataParallelSharding]] = {}
_Sharding = TypeVar("_Sharding", bound="type[DataParallelSharding]")


def register_sharding(name: str) -> Callable[[_Sharding], _Sharding]:
    """Class decorator: the sharding under ``name`` in :data:`SHARDINGS`, which ``ParallelConfig.sharding`` and
    the ZeRO stages' names (:mod:`~lightning_parallel.parallel.data.stages`) pick from.

    Args:
        name: lowercase, unique (``zero3``, ``zero3_qwz``, ...).
    """

    def register(cls: _Sharding) -> _Sharding:
        taken = SHARDINGS.get(name)
        if taken is not None and taken is not cls:
            raise ValueError(
                f"sharding {name!r} names {taken.__name__} already: register {cls.__name__} under another name."
            )
        cls.name = name
        SHARDINGS[name] = cls
        return cls

    return register


class DataParallelSharding:
    """How model states are split over the data-parallel ranks of ``mesh``, and how gradients meet there.

    Args:
        mesh: the 1-D mesh of the ranks that shard (or replicate) the states.
        expert_mesh: the 1-D mesh of the ranks holding the same experts (default ``mesh``).
        hsdp_mesh: HSDP (``dp_shard``): the 2-D (replicate, shard) mesh; None without replicas.
        offload: keep the sharded states on the host (stages that allow it).
        reshard_after_forward: stage 3's FSDP2 setting.
        grad_compression: ``none``, ``bf16`` or ``fp16``: the dtype of the gradient reduction
            (:mod:`~lightning_parallel.parallel.data.compression`); ``powersgd``: low-rank factors of each gradient
            matrix (:mod:`~lightning_parallel.parallel.data.powersgd`, stages 0-2), of rank ``powersgd_rank``.
        overlap_grad_reduce, bucket_mb: reduce gradients in buckets of ``bucket_mb`` MB during backward
            (:mod:`~lightning_parallel.parallel.data.overlap`; stages 0-2, also under pipelines).
        param_dtype: the dtype stage 3 gathers parameters in and computes with (bf16 under ``bf16-mixed``, from the
            strategy's precision); None: their own. Stages 0-2 keep whole fp32 parameters and ignore it.
        setting: how the user named this layout, for error messages.
    """

    name: ClassVar[str]  # its name in SHARDINGS (register_sharding)
    stage: ClassVar[int]  # the ZeRO stage whose formulas it follows
    sharded: ClassVar[frozenset[str]]  # which of MODEL_STATES are split over the ranks
    comm_factor: ClassVar[float]  # bytes sent per step per rank, in units of a ring all-reduce of the gradients
    supports_offload: ClassVar[bool] = False
    supports_hsdp: ClassVar[bool] = True  # it can shard inside replicas (dp_shard)
    planned: ClassVar[bool] = False  # the planners also weigh it by name (its stage's counts, these formulas)
    summary: ClassVar[str]

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        expert_mesh: DeviceMesh | None = None,
        hsdp_mesh: DeviceMesh | None = None,
        offload: bool = False,
        reshard_after_forward: bool = True,
        grad_compression: str = "none",
        powersgd_rank: int = 4,
        overlap_grad_reduce: bool = False,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype | None = None,
        setting: str = "",
    ) -> None:
        assert mesh.ndim == 1, "a sharding takes the 1-D mesh of its ranks"
        self.overlap_grad_reduce, self.bucket_mb = overlap_grad_reduce, bucket_mb
        self.grad_compression = grad_compression
        self.wire_dtype = wire_dtype(grad_compression)  # the dtype gradients are reduced in (None: their own)
        # powersgd: the factors' state (Q and error per matrix), kept across steps and in checkpoints
        self.powersgd = PowerSGD(powersgd_rank) if grad_compression == "powersgd" else None
        self.mesh = mesh
        # expert parameters (split over ep) meet over the ranks holding the same experts; their gradient is
        # divided by the whole data-parallel degree all the same (each expert saw the tokens of its ep group)
        self.expert_mesh = expert_mesh if expert_mesh is not None else mesh
        self.hsdp_mesh = hsdp_mesh
        self.offload = offload
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.setting = setting

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, **settings: Any) -> DataParallelSharding:
        """The sharding over the world's mesh: its ``shard`` role, ``expert_shard`` for expert parameters and, when
        the mesh has replicas (HSDP), the 2-D (``replicate``, ``shard``) mesh (a variant over other roles overrides
        this)."""
        hsdp = mesh.hsdp_mesh() if mesh.dims.dpr > 1 else None
        return cls(mesh["shard"], expert_mesh=mesh["expert_shard"], hsdp_mesh=hsdp, **settings)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the sharding spans (a flattened ``dp_ep`` is both)."""
        names = self.mesh.mesh_dim_names
        assert names, "meshes here have named axes"
        return tuple(names[0].split("_"))

    @property
    def expert_axes(self) -> tuple[str, ...]:
        names = self.expert_mesh.mesh_dim_names
        assert names, "meshes here have named axes"
        return tuple(names[0].split("_"))

    @property
    def group(self) -> torch.distributed.ProcessGroup:
        return self.mesh.get_group()

    @property
    def expert_group(self) -> torch.distributed.ProcessGroup:
        return self.expert_mesh.get_group()

    @property
    def replicas(self) -> int:
        """HSDP's replicas (1 without)."""
        return self.hsdp_mesh.size(0) if self.hsdp_mesh is not None else 1

    @property
    def replicate_group(self) -> torch.distributed.ProcessGroup | None:
        """HSDP: the ranks holding the same shard in the other replicas (None without replicas)."""
        return self.hsdp_mesh.get_group(0) if self.hsdp_mesh is not None else None

    @property
    def data_parallel_size(self) -> int:
        """Every data-parallel rank: what every gradient, expert or not, is divided by."""
        return self.mesh.size() * self.replicas

    # ----- the steps -----

    def shard_module(self, root: nn.Module, units: list[str] | None = None) -> list[str]:
        """Shard ``root``'s parameters in place (ZeRO-3); returns the module paths made units."""
        return []

    def shard_optimizer(self, optimizer: Optimizer) -> None:
        """Take a fresh optimizer from ``configure_optimizers`` (stages 1-2 re-point it at a slice)."""
        if self.sharded:
            check_shardable_optimizer(optimizer, self.setting)
        if self.powersgd is not None:
            self.powersgd.track(trainable(optimizer))

    def before_last_backward(
        self,
        optimizer: Optimizer,
        only: list[nn.Parameter] | None = None,
        prepare: Callable[[nn.Parameter], None] | None = None,
    ) -> None:
        """The next backward is the last of an optimizer step (not a micro-step of gradient accumulation): a
        sharding that overlaps its reduction with backward arms its hooks here, for ``only`` these parameters
        (None: all; a pipeline arms each stage's with :meth:`arm_more` before its last microbatch), each gradient
        passed through ``prepare`` first (:mod:`~lightning_parallel.parallel.data.overlap`)."""

    def arm_more(self, optimizer: Optimizer, params: list[nn.Parameter], ready: bool = False) -> None:
        """Under a pipeline: these parameters' gradients are complete after the backward about to run; ``ready``:
        that backward has run (a weight-only backward assigns gradients without autograd's hooks)."""

    def settle_params(self) -> None:
        """Wait for any parameter gather still in flight (ZeRO 1-2 with ``overlap_grad_reduce``): before anything
        but the forward reads the parameters (checkpoints, the end of fit)."""

    def overlap_stats(self) -> dict[str, int]:
        """With ``overlap_grad_reduce``: the buckets, and how many of them the last step launched during backward."""
        return {}

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Once per optimizer step, after the last backward: make the gradients the data-parallel mean."""

    def grad_pieces(self, optimizer: Optimizer) -> list[GradPiece]:
        """This rank's gradients of ``optimizer``'s parameters, each with the mesh axes that split it."""
        params = (p for g in optimizer.param_groups for p in g["params"])
        return [(local(p.grad), p, split_axes(p.grad)) for p in params if p.grad is not None]

    def after_step(self, optimizer: Optimizer) -> None:
        """After ``optimizer_step`` (also one that fp16 skipped)."""

    def state_view(self, optimizer: Optimizer) -> StateView | None:
        """What checkpoints read and fill of ``optimizer``'s state: None when the optimizer holds it per model
        parameter, as torch's does (ZeRO 0 and 3), else the flat slices it steps (ZeRO 1-2)."""
        return None

    def param_groups(self, optimizer: Optimizer) -> list[list[nn.Parameter]]:
        """The model parameters of each of the optimizer's groups, as ``configure_optimizers`` built them."""
        return [list(g["params"]) for g in optimizer.param_groups]

    # ----- the formulas (Rajbhandari et al., 2020) -----

    @classmethod
    def state_bytes(cls, param_bytes: float, dp: int, optimizer_states: int = 2) -> float:
        """Parameter, gradient and optimizer-state bytes on one rank whose (unsharded) parameters take
        ``param_bytes``: gradients as large, ``optimizer_states`` tensors as large each (Adam: 2)."""
        sizes = {"params": param_bytes, "grads": param_bytes, "optimizer": optimizer_states * param_bytes}
        return sum(size / dp if state in cls.sharded else size for state, size in sizes.items())

    @classmethod
    def state_bytes_exact(cls, num_params: int, dp: int, elem: int = 4, optimizer_states: int = 2) -> int:
        """:meth:`state_bytes` in whole bytes, the sharded part rounded up (flat buffers are padded)."""
        sizes = {"params": elem * num_params, "grads": elem * num_params}
        sizes["optimizer"] = elem * optimizer_states * num_params
        whole = sum(size for state, size in sizes.items() if state not in cls.sharded)
        return whole + math.ceil(sum(size for state, size in sizes.items() if state in cls.sharded) / dp)

    @classmethod
    def comm_bytes(cls, grad_bytes: float, dp: int, gather_ratio: float = 1.0) -> float:
        """Bytes one rank sends per step: ``comm_factor`` ring all-reduces of the gradients, 2 g (w-1)/w each.
        ``gather_ratio``: the gathered parameters' element size over the gradients' (0.5 where ZeRO-3 gathers bf16
        under ``bf16-mixed``); a sharding that gathers no parameters in another dtype ignores it."""
        return cls.comm_factor * 2 * grad_bytes * (dp - 1) / dp if dp > 1 else 0.0
