"""The interface every data-parallel sharding implements: one subclass per ZeRO stage. Pure torch.

A sharding is told the mesh it shards over (the mesh's ``shard`` role) and is asked, in this order, to shard
the model (ZeRO-3 wraps it in FSDP2 units; the others leave it), to shard each optimizer, to reduce the
gradients after the last backward of a step, to hand its local gradient pieces to clipping, and to clean up
after the step. Its class attributes are the ZeRO paper's formulas, so the planner, the profiler and the
memory report compute one quantity one way.

Adding a variant (HSDP, ZeRO++'s hpZ, ...): a subclass in a module of its own beside these, and a row in
:mod:`lightning_parallel.parallel.data.stages`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.parallel.data.compression import wire_dtype
from lightning_parallel.parallel.data.powersgd import PowerSGD
from lightning_parallel.parallel.dtensor import local, split_axes
from lightning_parallel.parallel.mesh import ParallelMesh

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
    """Refuse optimizers whose math changes when the parameters are split.

    Raises:
        TypeError: naming the optimizer, the setting and the optimizers that work.
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
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


class DataParallelSharding:
    """How model states are split over the data-parallel ranks of ``mesh``, and how gradients meet there.

    Args:
        mesh: the 1-D mesh of the ranks that shard (or replicate) the states.
        offload: keep the sharded states on the host (stages that allow it).
        reshard_after_forward: stage 3's FSDP2 setting.
        grad_compression: ``none``, ``bf16`` or ``fp16``: the dtype of the gradient reduction
            (:mod:`~lightning_parallel.parallel.data.compression`); ``powersgd``: low-rank factors of each gradient
            matrix (:mod:`~lightning_parallel.parallel.data.powersgd`, stages 0-2), of rank ``powersgd_rank``.
        overlap_grad_reduce, bucket_mb: reduce gradients in buckets of ``bucket_mb`` MB during backward
            (:mod:`~lightning_parallel.parallel.data.overlap`; stages 0-2, also under pipelines).
        setting: how the user named this layout, for error messages.
    """

    stage: ClassVar[int]
    sharded: ClassVar[frozenset[str]]  # which of MODEL_STATES are split over the ranks
    comm_factor: ClassVar[float]  # bytes sent per step per rank, in units of a ring all-reduce of the gradients
    supports_offload: ClassVar[bool] = False
    summary: ClassVar[str]

    def __init__(
        self,
        mesh: DeviceMesh,
        *,
        expert_mesh: DeviceMesh | None = None,
        offload: bool = False,
        reshard_after_forward: bool = True,
        grad_compression: str = "none",
        powersgd_rank: int = 4,
        overlap_grad_reduce: bool = False,
        bucket_mb: float = 25.0,
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
        self.offload = offload
        self.reshard_after_forward = reshard_after_forward
        self.setting = setting

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, **settings: Any) -> DataParallelSharding:
        """The sharding over the world's mesh: its ``shard`` role, and ``expert_shard`` for expert parameters (a
        variant over other roles overrides this)."""
        return cls(mesh["shard"], expert_mesh=mesh["expert_shard"], **settings)

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
    def data_parallel_size(self) -> int:
        """Every data-parallel rank: what every gradient, expert or not, is divided by."""
        return self.mesh.size()

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

    def flat(self, optimizer: Optimizer) -> Any:
        """The ZeRO-1/2 flat buffers of ``optimizer`` (checkpoints read their ranges), None for other stages."""
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
    def comm_bytes(cls, grad_bytes: float, dp: int) -> float:
        """Bytes one rank sends per step: ``comm_factor`` ring all-reduces of the gradients, 2 g (w-1)/w each."""
        return cls.comm_factor * 2 * grad_bytes * (dp - 1) / dp if dp > 1 else 0.0


def describe_stages(stages: Sequence[type[DataParallelSharding]]) -> str:
    return "; ".join(f"{s.stage}: {s.summary}" for s in stages)
