"""The process-level half of the mesh strategies: launching, the process group and the mesh (with the
data-parallel sharding over its ``shard`` role), which device and rank this is, collectives over the world or a
role of the mesh, and what happens when a rank fails (``parallel/failure.py``). Mixed into
:class:`~lightning_parallel.strategies.base.MeshStrategy`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.parallel import strict
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.data.stages import make_sharding
from lightning_parallel.parallel.failure import (
    FailureBoard,
    annotate,
    end_children,
    is_collective_failure,
    report_now,
)
from lightning_parallel.parallel.fault_tolerance import check_backend, lighthouse_address, sampler_kwargs
from lightning_parallel.parallel.heartbeat import dump_folder, enable_flight_recorder, start_watch
from lightning_parallel.parallel.mesh import ParallelDims, ParallelMesh
from lightning_parallel.parallel.shutdown import release_at_exit
from lightning_parallel.plugins.precision import param_dtype_of
from lightning_parallel.strategies.launcher import CheckFirstLauncher

_SUM, _MAX, _MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
_OPS = {"sum": _SUM, "mean": _SUM, "avg": _SUM, "max": _MAX, "min": _MIN}  # a mean is a sum divided (gloo has no AVG)


def reduce_in_place(tensor: Tensor, group: dist.ProcessGroup, size: int, reduce_op: Any) -> Tensor:
    """Lightning's ``_sync_ddp`` (``tensor`` reduced in place over ``group``) without what a step can do without: no
    barrier before the all-reduce (the all-reduce waits for every rank itself) and no collective over a group of one
    (a loss over a dp of 1 under tp or pp). ``reduce_op``: ``"mean"`` / ``"avg"``, ``"sum"``, ``"max"``, ``"min"`` or
    a ``ReduceOp``; anything else goes to Lightning's."""
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    if name not in _OPS and not isinstance(reduce_op, dist.ReduceOp.RedOpType):
        return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    if size == 1:
        return tensor
    dist.all_reduce(tensor, op=_OPS[name] if name is not None else reduce_op, group=group)
    if name not in ("mean", "avg"):
        return tensor
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)


def set_world_ranks(strategy: Any) -> None:
    """Lightning's rank bookkeeping of a one-process-per-device strategy (as its DDPStrategy does): the cluster
    environment's global rank and world size, and the rank rank_zero_only reads."""
    if strategy.cluster_environment is not None:
        rank = strategy.node_rank * strategy.num_processes + strategy.local_rank
        strategy.cluster_environment.set_global_rank(rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


class DistributedMixin:
    """Expects ``config``, ``parallel_devices``, ``cluster_environment``, ``_launcher``, ``_timeout``,
    ``_process_group_backend``, ``_dims`` and ``_parallel`` from the strategy; sets ``_mesh``, ``_sharding`` and
    ``_failures``; gives the mesh by role, the degrees and the sampler's arguments (both front doors)."""

    # ----- what subclasses decide -----

    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        return self.config.dims(world_size)

    def _setting(self) -> str:
        """How the user named this layout, for error messages."""
        return self.config.describe(self._name())

    def _name(self) -> str:
        return getattr(self, "strategy_name", type(self).__name__)

    def _precision_of(self) -> Any:
        """The Trainer's precision plugin, or Fabric's (a Fabric strategy's ``precision``)."""
        return self.precision_plugin if hasattr(type(self), "precision_plugin") else self.precision

    # ----- the mesh -----

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            self._dims = self._parallel_degrees(self.world_size)
        return self._dims

    @property
    def mesh(self) -> ParallelMesh:
        """The world's mesh, by role (``batch``, ``loss``, ``shard``, ``stage``, ``tensor``) or axis."""
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once the strategy has set up its process group.")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's mesh with one named dimension per axis."""
        return self.mesh.device_mesh

    @property
    def sharding(self) -> DataParallelSharding:
        if self._sharding is None:
            raise RuntimeError("The data-parallel sharding exists once the strategy has set up its process group.")
        return self._sharding

    @property
    def fsdp_units(self) -> list[str]:
        return self._parallel.fsdp_units if self._parallel is not None else []

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of one batch index sees the same samples: pipeline stages, tensor shards and cp ranks share one
        kwargs = {"num_replicas": self.parallel_dims.role_size("batch"), "rank": self.mesh.rank("batch")}
        return sampler_kwargs(self.config, kwargs)  # fault_tolerance='torchft': the other replica groups' too

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank that fails leaves word of it; a rank whose collective failed names the rank that failed
        first; the process that launched the others (Lightning's launcher) gives them 5 s, then kills them."""
        if self._failures is not None and isinstance(exception, Exception):
            if is_collective_failure(exception):
                annotate(exception, self._failures.explain(), self.global_rank)
            else:
                self._failures.record(exception)
            report_now(exception)  # before a launcher's signal can stop this process unheard
        procs = getattr(self._launcher, "procs", None)
        if procs and not isinstance(exception, SystemExit):  # SystemExit: a preemption stop, every rank exits
            end_children(procs, grace_s=min(self._timeout.total_seconds(), 5.0))

    # ----- collectives -----

    @override
    def barrier(self, name: str | None = None) -> None:
        if _compat.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the ``loss`` role by default (the ``batch`` ranks, and under cp the ranks holding pieces of the
        same sequences, whose token means average to the whole sequence's): pipeline stages and tensor shards hold
        the same values."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            return reduce_in_place(tensor, self.mesh.group("loss"), self.mesh.size("loss"), reduce_op)
        return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes (Lightning counts the votes against the world size; ``reduce`` sums over dp only)."""
        if not _compat.distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._dims = self._parallel_degrees(self.world_size)  # bad degrees fail here, before any process starts
        self._dims.check_node_size(self.num_processes, self.num_nodes)  # tp, cp, dp_shard inside a node
        if not self.cluster_environment.creates_processes_externally:
            grace_s = min(self._timeout.total_seconds(), 10.0)  # for the launching rank to say which rank failed
            env = self.cluster_environment
            self._launcher = CheckFirstLauncher(self, env, self.num_processes, self.num_nodes, grace_s=grace_s)

    def _check_launched_world(self) -> None:
        """Under torchrun or SLURM: the processes started must be the ones the Trainer was told about."""
        env = self.cluster_environment
        if env is None or not env.creates_processes_externally:
            return
        expected, launched = self.num_nodes * self.num_processes, env.world_size()
        if launched != expected or env.local_rank() >= self.num_processes:
            raise ValueError(
                f"Trainer(devices={self.num_processes}, num_nodes={self.num_nodes}) expects {expected} processes, "
                f"but the launcher started {launched} (this one has LOCAL_RANK={env.local_rank()}): set devices to "
                "the processes per node (torchrun --nproc-per-node) and num_nodes to the number of nodes."
            )

    @override
    def setup_environment(self) -> None:
        self._check_launched_world()  # before the device is chosen and any process group exists
        super().setup_environment()
        if self.config.fault_tolerance == "torchft":
            check_backend(self.root_device)
            lighthouse_address(self.config.ft_lighthouse)
        reset_seed()
        self.set_world_ranks()
        dims = self.parallel_dims
        backend = self._process_group_backend or _compat.default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        enable_flight_recorder()  # before the first group: a hang's dump shows each rank's last collectives
        _compat.init_dist_connection(self.cluster_environment, backend, **kwargs)
        strict.enable_from_env()  # LP_STRICT_COLLECTIVES=1: gloo keeps NCCL's rules (every group, side groups too)
        release_at_exit()  # the groups go before the interpreter does: a finished run exits 0
        if self._mesh is None:  # once per strategy: validate/test after fit run on the model fit split
            # the run's timeout, Lightning's default (30 minutes) too: torch would give new NCCL groups 10 minutes
            self._mesh = dims.build_mesh(self.root_device.type, timeout=self._timeout)
            param_dtype = param_dtype_of(self._precision_of())  # ZeRO-3 under bf16-mixed gathers bf16
            self._sharding = make_sharding(self.config, self._mesh, setting=self._setting(), param_dtype=param_dtype)
        self._failures = FailureBoard.for_process_group()
        # NCCL: a dead peer is named and this rank's collectives fail, not hang; every backend: a hang is named
        self._failure_watch = start_watch(
            self._failures, backend, self._timeout, self._trainer_step(), self._dump_folder, self._end_children
        )

    def _trainer_step(self) -> Any:
        """The Trainer's global step, read by the heartbeat's thread (None under Fabric: it counts optimizer steps)."""
        module = getattr(self, "lightning_module", None)
        trainer = _compat.attached_trainer(module) if module is not None else None
        return None if trainer is None else lambda: trainer.global_step

    def _dump_folder(self) -> Any:
        module = getattr(self, "lightning_module", None)
        trainer = _compat.attached_trainer(module) if module is not None else None
        return dump_folder(trainer.default_root_dir if trainer is not None else None)

    def _end_children(self) -> None:
        """Before a hung run's process ends: the ranks Lightning's launcher started from it go too."""
        end_children(getattr(self._launcher, "procs", None) or [], grace_s=0.0)

    def end_failure_watch(self) -> None:
        """This rank's work ended normally (teardown): stop watching, and say so on the board."""
        watch = self.__dict__.pop("_failure_watch", None)
        if watch is not None:
            watch.stop()
        if self._failures is not None:
            self._failures.mark_done()
