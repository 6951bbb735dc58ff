"""The process-level work both front doors share, as functions (Lightning's way between its Trainer and Fabric
strategies): launching, the process group (then the runtime's mesh and sharding), which device and rank this is,
collectives over the world or a role of the mesh, and what happens when a rank fails (``parallel/failure.py``).

:class:`~lightning_parallel.strategies.base.MeshStrategy` and :class:`~lightning_parallel.fabric.strategy.
MeshFabricStrategy` each call them from their own hook methods (one line each). They take what they need: the
``runtime`` (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`: the degrees, mesh, sharding, the process
group's backend and timeout, the failure board) and Lightning's public attributes (``cluster_environment``,
``root_device``, ranks); nothing here keeps state."""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

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


def door_views(door: type) -> type:
    """A class decorator giving a front door (Trainer's or Fabric's) what both show alike, with no state of their
    own: the layout as read-only properties over its ``runtime`` (``config``; ``parallel_dims``, the degrees worked
    out for the door's world size on first ask; ``mesh``, by role ``batch``, ``loss``, ``shard``, ``stage``,
    ``tensor`` or by axis; ``sharding``) and Lightning's per-process bookkeeping as its ``DDPStrategy`` keeps it
    (``root_device``, ``num_processes``, ``distributed_sampler_kwargs``, ``set_world_ranks``) and its collectives
    over the world (``barrier``, ``broadcast``, ``reduce_boolean_decision``)."""

    def config(self: Any) -> ParallelConfig:
        return self.runtime.config

    def parallel_dims(self: Any) -> ParallelDims:
        return self.runtime.dims if self.runtime.dims is not None else self.runtime.degrees(self.world_size)

    def mesh(self: Any) -> ParallelMesh:
        return self.runtime.require_mesh()

    def sharding(self: Any) -> DataParallelSharding:
        return self.runtime.require_sharding()

    def root_device(self: Any) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    def num_processes(self: Any) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def distributed_sampler_kwargs(self: Any) -> dict[str, Any]:
        return sampler_arguments(self.runtime, self.parallel_dims)

    def barrier_method(self: Any, name: str | None = None) -> None:
        barrier()

    def broadcast_method(self: Any, obj: Any, src: int = 0) -> Any:
        return broadcast(obj, src)

    def reduce_boolean_decision(self: Any, decision: bool, all: bool = True) -> bool:
        return vote(decision, all, self.root_device, self.world_size)

    views = (config, parallel_dims, mesh, sharding, root_device, num_processes, distributed_sampler_kwargs)
    for view in views:
        setattr(door, view.__name__, property(view))
    door.set_world_ranks = set_world_ranks
    door.barrier, door.broadcast = barrier_method, broadcast_method
    door.reduce_boolean_decision = reduce_boolean_decision
    return abc.update_abstractmethods(door)  # Lightning's abstract root_device now defined


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


def sampler_arguments(runtime: MeshRuntime, dims: ParallelDims) -> dict[str, Any]:
    """A sampler's ``num_replicas`` and ``rank``: every rank of one batch index sees the same samples (pipeline
    stages, tensor shards and cp ranks share one); under ``fault_tolerance='torchft'`` the other replica groups' too."""
    kwargs = {"num_replicas": dims.role_size("batch"), "rank": runtime.require_mesh().rank("batch")}
    return sampler_kwargs(runtime.config, kwargs)


def barrier() -> None:
    if _compat.distributed_is_initialized():
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    if not _compat.distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(runtime: MeshRuntime, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Over the ``loss`` role by default (the ``batch`` ranks, and under cp the ranks holding pieces of the same
    sequences, whose token means average to the whole sequence's): pipeline stages and tensor shards hold the same
    values. Over ``group`` (or the world before the mesh exists) as Lightning reduces."""
    if not isinstance(tensor, Tensor):
        return tensor
    if group is None and runtime.mesh is not None:
        return runtime.reduce(tensor, reduce_op)
    return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def vote(decision: bool, all: bool, device: torch.device, world_size: int) -> bool:
    """Every rank votes (Lightning counts the votes against the world size; ``reduce`` sums over dp only)."""
    if not _compat.distributed_is_initialized():
        return decision
    votes = torch.tensor(int(decision), device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return bool(votes == world_size) if all else bool(votes)


def start_rank(strategy: Any, precision: str | None, trainer: Any = None) -> None:
    """A door's ``setup_environment`` after Lightning's (the device is set): torchft's checks, the seed, the ranks,
    the degrees (bad ones fail without a process group), the process group with the runtime's mesh and sharding,
    and the failure watch. ``strategy``: the door (its ``runtime`` and Lightning's public attributes);
    ``precision``: its name; ``trainer``: the Trainer's (None under Fabric: no global step to report)."""
    runtime: MeshRuntime = strategy.runtime
    if runtime.config.fault_tolerance == "torchft":
        check_backend(strategy.root_device)
        lighthouse_address(runtime.config.ft_lighthouse)
    reset_seed()
    set_world_ranks(strategy)
    if runtime.dims is None:
        runtime.degrees(strategy.world_size)
    open_process_group(runtime, strategy.cluster_environment, strategy.root_device, precision)
    step = None if trainer is None else lambda: trainer.global_step
    root = trainer.default_root_dir if trainer is not None else None
    runtime.watch_failures(step, lambda: dump_folder(root), lambda grace_s=0.0: end_launched(strategy, grace_s))


def end_launched(strategy: Any, grace_s: float = 0.0) -> None:
    """The ranks Lightning's launcher started from this process end (after ``grace_s``): a failed or hung run."""
    procs = getattr(getattr(strategy, "_launcher", None), "procs", None)
    if procs:
        end_children(procs, grace_s=grace_s)


def on_failure(strategy: Any, exception: BaseException) -> None:
    """A rank that fails leaves word of it (the runtime's board); the process that launched the others
    (Lightning's launcher) gives them 5 s, then kills them."""
    runtime: MeshRuntime = strategy.runtime
    runtime.record_failure(exception, strategy.global_rank)
    if not isinstance(exception, SystemExit):  # SystemExit: a preemption stop, every rank exits
        end_launched(strategy, grace_s=min(runtime.timeout.total_seconds(), 5.0))


def launcher(strategy: Any) -> CheckFirstLauncher | None:
    """The Trainer's launcher for ``devices=N`` in a plain script (None when the processes start outside: torchrun,
    SLURM): checks the model first, and gives the launching rank up to 10 s to say who failed. The degrees are
    resolved first: bad ones fail before any process starts (tp, cp, dp_shard inside a node)."""
    env = strategy.cluster_environment
    strategy.runtime.degrees(strategy.world_size, strategy.num_processes, strategy.num_nodes)
    if env.creates_processes_externally:
        return None
    grace_s = min(strategy.runtime.timeout.total_seconds(), 10.0)
    return CheckFirstLauncher(strategy, env, strategy.num_processes, strategy.num_nodes, grace_s=grace_s)
