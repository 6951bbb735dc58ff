"""The process-level Lightning hooks both front doors share: launching, the process group (then the runtime's
mesh and sharding), which device and rank this is, collectives over the world or a role of the mesh, and what happens
when a rank fails (``parallel/failure.py``). Functions taking what they need (:func:`check_launched_world`,
:func:`open_process_group`, :func:`set_world_ranks`), and :class:`DistributedHooks`, Lightning's hook methods over
them, inherited by :class:`~lightning_parallel.strategies.base.MeshStrategy` and
:class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy`: it keeps no state; what a layout has is the
``runtime``'s (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`: the degrees, mesh, sharding, the process
group's backend and timeout, the failure board), the rest Lightning's public attributes."""

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
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.failure import end_children
from lightning_parallel.parallel.fault_tolerance import check_backend, lighthouse_address, sampler_kwargs
from lightning_parallel.parallel.heartbeat import dump_folder, enable_flight_recorder
from lightning_parallel.parallel.mesh import ParallelDims, ParallelMesh
from lightning_parallel.parallel.shutdown import release_at_exit
from lightning_parallel.strategies.launcher import CheckFirstLauncher
from lightning_parallel.strategies.runtime import MeshRuntime


def set_world_ranks(strategy: Any) -> None:
    """Lightning's rank bookkeeping of a one-process-per-device strategy (as its DDPStrategy does): the cluster
    environment's global rank and world size, and the rank rank_zero_only reads."""
    if strategy.cluster_environment is not None:
        rank = strategy.node_rank * strategy.num_processes + strategy.local_rank
        strategy.cluster_environment.set_global_rank(rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def check_launched_world(env: Any, num_nodes: int, num_processes: int) -> None:
    """Under torchrun or SLURM (``env`` creates the processes): the processes started must be the ones the Trainer
    was told about (``num_nodes`` times ``num_processes``), before any device is chosen or process group exists."""
    if env is None or not env.creates_processes_externally:
        return
    expected, launched = num_nodes * num_processes, env.world_size()
    if launched != expected or env.local_rank() >= num_processes:
        raise ValueError(
            f"Trainer(devices={num_processes}, num_nodes={num_nodes}) expects {expected} processes, "
            f"but the launcher started {launched} (this one has LOCAL_RANK={env.local_rank()}): set devices to "
            "the processes per node (torchrun --nproc-per-node) and num_nodes to the number of nodes."
        )


def open_process_group(runtime: MeshRuntime, env: Any, device: torch.device, precision: str | None) -> None:
    """The world's process group over ``env`` on ``device`` (the runtime's backend, else the device's default; its
    timeout), then the runtime's mesh and sharding (once per runtime)."""
    if runtime.backend is None:
        runtime.backend = _compat.default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": runtime.timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    enable_flight_recorder()  # before the first group: a hang's dump shows each rank's last collectives
    _compat.init_dist_connection(env, runtime.backend, **kwargs)
    strict.enable_from_env()  # LP_STRICT_COLLECTIVES=1: gloo keeps NCCL's rules (every group, side groups too)
    release_at_exit()  # the groups go before the interpreter does: a finished run exits 0
    runtime.start(device, precision)


class DistributedHooks:
    """The process-level Lightning hooks both front doors share, over ``runtime`` and Lightning's public attributes
    (``parallel_devices``, ``cluster_environment``, ranks): the mesh by role, the degrees, the sampler's arguments,
    the process group, collectives, failures."""

    runtime: MeshRuntime

    @property
    def config(self) -> ParallelConfig:
        """The parallel settings (the runtime's)."""
        return self.runtime.config

    def _name(self) -> str:
        return getattr(self, "strategy_name", type(self).__name__)

    def _precision_name(self) -> str | None:
        """The precision's name: the Trainer's precision plugin's, or Fabric's (a Fabric strategy's ``precision``)."""
        plugin = self.precision_plugin if hasattr(type(self), "precision_plugin") else self.precision
        return getattr(plugin, "precision", None)

    # ----- the mesh -----

    @property
    def parallel_dims(self) -> ParallelDims:
        return self.runtime.dims if self.runtime.dims is not None else self.runtime.degrees(self.world_size)

    @property
    def mesh(self) -> ParallelMesh:
        """The world's mesh, by role (``batch``, ``loss``, ``shard``, ``stage``, ``tensor``) or axis."""
        return self.runtime.require_mesh()

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's mesh with one named dimension per axis."""
        return self.mesh.device_mesh

    @property
    def sharding(self) -> DataParallelSharding:
        return self.runtime.require_sharding()

    @property
    def fsdp_units(self) -> list[str]:
        return self.runtime.fsdp_units

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
        """A rank that fails leaves word of it (the runtime's board); the process that launched the others
        (Lightning's launcher) gives them 5 s, then kills them."""
        self.runtime.record_failure(exception, self.global_rank)
        if not isinstance(exception, SystemExit):  # SystemExit: a preemption stop, every rank exits
            self._end_children(grace_s=min(self.runtime.timeout.total_seconds(), 5.0))

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
        if group is None and self.runtime.mesh is not None:
            return self.runtime.reduce(tensor, reduce_op)
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
        # bad degrees fail here, before any process starts; tp, cp, dp_shard inside a node
        self.runtime.degrees(self.world_size, self.num_processes, self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            grace_s = min(self.runtime.timeout.total_seconds(), 10.0)  # for the launching rank to say who failed
            env = self.cluster_environment
            self._launcher = CheckFirstLauncher(self, env, self.num_processes, self.num_nodes, grace_s=grace_s)

    def _check_launched_world(self) -> None:
        check_launched_world(self.cluster_environment, self.num_nodes, self.num_processes)

    @override
    def setup_environment(self) -> None:
        self._check_launched_world()  # before the device is chosen and any process group exists
        super().setup_environment()
        if self.config.fault_tolerance == "torchft":
            check_backend(self.root_device)
            lighthouse_address(self.config.ft_lighthouse)
        reset_seed()
        self.set_world_ranks()
        self.parallel_dims  # noqa: B018  (resolved before the process group: bad degrees fail without one)
        open_process_group(self.runtime, self.cluster_environment, self.root_device, self._precision_name())
        self.runtime.watch_failures(self._trainer_step(), self._dump_folder, self._end_children)

    def _trainer_step(self) -> Any:
        """The Trainer's global step, read by the heartbeat's thread (None under Fabric: it counts optimizer steps)."""
        module = getattr(self, "lightning_module", None)
        trainer = _compat.attached_trainer(module) if module is not None else None
        return None if trainer is None else lambda: trainer.global_step

    def _dump_folder(self) -> Any:
        module = getattr(self, "lightning_module", None)
        trainer = _compat.attached_trainer(module) if module is not None else None
        return dump_folder(trainer.default_root_dir if trainer is not None else None)

    def _end_children(self, grace_s: float = 0.0) -> None:
        """The ranks Lightning's launcher started from this process end (after ``grace_s``): a failed or hung run."""
        procs = getattr(self._launcher, "procs", None)  # type: ignore[attr-defined]
        if procs:
            end_children(procs, grace_s=grace_s)

    def end_failure_watch(self) -> None:
        """This rank's work ended normally (teardown): stop watching, and say so on the board."""
        self.runtime.end_watch()
