"""MeshRuntime: the one object both front doors hold (``strategy.runtime``) and the work they share.

The Trainer's :class:`~lightning_parallel.strategies.base.MeshStrategy` and Fabric's
:class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy` are adapters over it: each turns its framework's
calls (Lightning's hooks, ``fabric.setup`` / ``backward`` / ``clip_gradients`` / ``save``) into the runtime's, which
holds every piece of state a layout has (settings, degrees, mesh, sharding, what the split did, the unsplit model's
parameter names) and does what both need: resolve the degrees, build the mesh and the sharding, split the model
(:meth:`MeshRuntime.split`: the one place a module's ``loss`` is replaced), reduce a step's gradients once, clip by
the whole model's norm, reduce a logged value, cut a batch, save and load sharded folders. The runtime holds no
Lightning object; the doors pass in what it needs (the device, the precision's name, the RNG state of a meta build).

May import: ``lightning_parallel.parallel``, ``lightning_parallel.protocol``, ``lightning_parallel.plugins`` and the
strategies' free-function modules (checks, sharded_checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer

from lightning_parallel import _compat
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.powersgd import embedding_weights
from lightning_parallel.parallel.data.sharding import DataParallelSharding, StateView
from lightning_parallel.parallel.data.stages import make_sharding
from lightning_parallel.parallel.failure import FailureBoard, annotate, is_collective_failure, report_now, to_timeout
from lightning_parallel.parallel.heartbeat import start_watch
from lightning_parallel.parallel.materialize import splits_model
from lightning_parallel.parallel.mesh import ParallelDims, ParallelMesh
from lightning_parallel.parallel.optim.muon import check_muon_precision
from lightning_parallel.parallel.parallelize import Parallelized, parallelize
from lightning_parallel.parallel.pipeline.split import PipelineSplit
from lightning_parallel.parallel.step import clip_model_grad_norm, reduce_step_gradients
from lightning_parallel.parallel.tensor.loss import vocab_parallel_loss
from lightning_parallel.plugins.precision import param_dtype_for
from lightning_parallel.protocol import has_loss
from lightning_parallel.strategies import sharded_checkpoint
from lightning_parallel.strategies.checks import check_model

Log = Callable[[str], Any]
DEFAULT_TIMEOUT = timedelta(minutes=30)  # Lightning's (and torch's) default bound of a collective


def build_config(owner: str, config: ParallelConfig | None, settings: dict[str, Any], warn: Log) -> ParallelConfig:
    """A strategy's validated settings: ``config`` (or the defaults) with ``settings`` over it (both front doors).

    Raises:
        TypeError: a setting ParallelConfig does not have, naming the ones it has.
    """
    unknown = set(settings) - set(ParallelConfig.names())
    if unknown:
        raise TypeError(
            f"{owner} got unknown setting(s) {', '.join(sorted(unknown))}: use the names of "
            f"ParallelConfig ({', '.join(ParallelConfig.names())}) or Lightning's strategy arguments."
        )
    base = config if config is not None else ParallelConfig()
    # the settings carried as given: validate() hands back the same object unless it fills in derived values
    return (dataclasses.replace(base, **settings) if settings else base).validate(warn=warn)


class MeshRuntime:
    """A layout's state and the work on it, shared by the Trainer's and Fabric's strategies.

    Args:
        config: the validated settings (:func:`build_config`).
        timeout: bounds every collective, on the world and on each of the mesh's groups.
        name: how the user named the strategy (``"hybrid3d"``, ``"zero2"``), for error messages.
    """

    def __init__(self, config: ParallelConfig, timeout: timedelta, name: str, backend: str | None = None) -> None:
        self.config = config
        self.timeout = timeout
        self.name = name
        self.backend = backend  # the process group's backend: the user's, else the device's default (at its start)
        self.dims: ParallelDims | None = None  # once the world size is known (degrees)
        self.mesh: ParallelMesh | None = None  # once the process group exists (start)
        self.sharding: DataParallelSharding | None = None
        self.failures: FailureBoard | None = None  # this process group's (the doors' setup_environment)
        self.applied: Parallelized | None = None  # what parallelize() did to the model (split)
        self.split_model: nn.Module | None = None  # the module parallelize() ran on: split once, reused after
        self.full_param_order: list[str] = []  # the unsplit model's parameter names: checkpoints number them
        self._reduced: set[int] = set()  # optimizers whose gradients were reduced since the last backward
        self.failure_watch: Any = None  # the heartbeat's thread while this rank works (distributed.start_watch)
        self._init_rng: Tensor | None = None  # the CPU generator's state when building on meta began
        self._meta_depth = 0  # Lightning nests tensor_init_context and model_sharded_context around configure_model
        self.label: str | None = None  # a preset's own name for the layout in messages ("strategy='zero2'")
        self.check_world: Callable[[int], None] | None = None  # a preset's refusal of a world size

    @classmethod
    def create(
        cls,
        owner: str,
        name: str,
        config: ParallelConfig | None,
        settings: dict[str, Any],
        timeout: Any,
        warn: Log,
        backend: str | None = None,
    ) -> MeshRuntime:
        """The runtime of a strategy built with ``config`` and ``settings`` (its keyword arguments); ``timeout``:
        a ``timedelta`` or seconds (None: Lightning's default, 30 minutes); ``backend``: the process group's."""
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        return cls(build_config(owner, config, settings, warn), to_timeout(timeout), name, backend)

    # ----- the layout -----

    def setting(self) -> str:
        """How the user named this layout, for error messages."""
        return self.label if self.label is not None else self.config.describe(self.name)

    def degrees(self, world_size: int, num_processes: int | None = None, num_nodes: int = 1) -> ParallelDims:
        """The degrees for ``world_size`` processes (kept as :attr:`dims`); with ``num_processes`` (per node) the
        node-local axes must tile a node. Bad degrees fail here, before any process starts."""
        if self.check_world is not None:
            self.check_world(world_size)
        self.dims = self.config.dims(world_size)
        if num_processes is not None:
            self.dims.check_node_size(num_processes, num_nodes)  # tp, cp, dp_shard inside a node
        return self.dims

    def check(self, model: Any, dims: ParallelDims) -> None:
        """Refuse a model ``dims`` cannot split (before any process group exists)."""
        check_model(model, self.config, dims)

    def start(self, device: torch.device, precision: str | None) -> None:
        """Once the process group exists: the mesh (every group with the run's timeout) and the data-parallel
        sharding over its ``shard`` role (ZeRO-3 under ``bf16-mixed`` gathers bf16). Once per runtime: validate and
        test after fit run on what fit built."""
        if self.mesh is not None:
            return
        assert self.dims is not None, "degrees() runs before start()"
        self.mesh = self.dims.build_mesh(device.type, timeout=self.timeout)
        param_dtype = param_dtype_for(precision)
        self.sharding = make_sharding(self.config, self.mesh, setting=self.setting(), param_dtype=param_dtype)

    def require_mesh(self) -> ParallelMesh:
        if self.mesh is None:
            raise RuntimeError("The device mesh exists once the strategy has set up its process group.")
        return self.mesh

    def require_sharding(self) -> DataParallelSharding:
        if self.sharding is None:
            raise RuntimeError("The data-parallel sharding exists once the strategy has set up its process group.")
        return self.sharding

    # ----- failures -----

    def watch_failures(self, step: Callable[[], int] | None, dump: Callable[[], Any], end: Callable[[], None]) -> None:
        """Once the process group exists: its failure board, and the heartbeat's thread (NCCL: a dead peer is named
        and this rank's collectives fail, not hang; every backend: a hang is named). ``step``: the Trainer's global
        step (None under Fabric); ``dump``: the folder of a hang's dump; ``end``: ends the ranks this one started."""
        self.failures = FailureBoard.for_process_group()
        self.failure_watch = start_watch(self.failures, self.backend, self.timeout, step, dump, end)

    def record_failure(self, exception: BaseException, rank: int) -> None:
        """A rank that fails leaves word of it on the board; a rank whose collective failed names in ``exception``
        the rank that failed first. Said at once (before a launcher's signal can stop this process unheard)."""
        if self.failures is None or not isinstance(exception, Exception):
            return
        if is_collective_failure(exception):
            annotate(exception, self.failures.explain(), rank)
        else:
            self.failures.record(exception)
        report_now(exception)

    def end_watch(self) -> None:
        """This rank's work ended normally: stop watching, and say so on the board."""
        watch, self.failure_watch = self.failure_watch, None
        if watch is not None:
            watch.stop()
        if self.failures is not None:
            self.failures.mark_done()

    # ----- the model -----

    @contextlib.contextmanager
    def built_on_meta(self) -> Generator[None, None, None]:
        """Build on the meta device (a layout that splits the model: each rank materializes only its pieces, with
        the values one process draws from the CPU generator's state noted here)."""
        if self._meta_depth == 0:
            self._init_rng = torch.random.get_rng_state()
        self._meta_depth += 1
        try:
            with torch.device("meta"):
                yield
        finally:
            self._meta_depth -= 1

    def take_init_rng(self) -> Tensor | None:
        """The CPU generator's state when the model was built on meta (once: a later setup reuses the split model)."""
        state, self._init_rng = self._init_rng, None
        return state

    def split(
        self,
        model: nn.Module,
        module: Any,
        device: torch.device,
        warn: Log,
        info: Log,
    ) -> Parallelized:
        """Split ``model`` in place over the mesh (:func:`parallelize`, the axes in their order); ``module`` offers
        the protocol methods (the LightningModule, or ``model`` itself). Under tp without pp the module's ``loss``
        takes the vocabulary-parallel logits (the one place it is replaced); under pp the door builds its runner
        over ``applied.split``. The split model is then on ``device``: each rank's pieces are there already (ZeRO-3
        offload: parameter shards on the host), and ``.to`` sets what the module reports as its device and moves
        torchmetrics' states (under offload on an accelerator FSDP2 brings the shards back to pinned host memory)."""
        self.full_param_order = [name for name, _ in model.named_parameters()]
        applied = parallelize(
            model,
            module,
            self.require_mesh(),
            self.config,
            self.require_sharding(),
            device,
            warn=warn,
            info=info,
            rng_state=self.take_init_rng(),  # a meta build replays the draws one process makes
        )
        keep_logits_split(module, applied, self.require_dims().tp)
        if splits_model(self.config):
            model.to(device)
        self.applied, self.split_model = applied, model
        return applied

    def require_dims(self) -> ParallelDims:
        assert self.dims is not None, "degrees() runs first"
        return self.dims

    @property
    def stages(self) -> PipelineSplit | None:
        """Under pp: this rank's stages (None otherwise, and before the split)."""
        return self.applied.split if self.applied is not None else None

    @property
    def fsdp_units(self) -> list[str]:
        return self.applied.fsdp_units if self.applied is not None else []

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of every sample under cp (sequence chunks) or spatial (image strips); else ``batch``."""
        if self.applied is not None and self.applied.splits_samples:
            return self.applied.shard_batch(batch)
        return batch

    # ----- gradients -----

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around backward: under tp the vocabulary-parallel loss's own backward rules."""
        return loss_parallel() if self.require_dims().tp > 1 else contextlib.nullcontext()

    def new_backward(self) -> None:
        """A backward ran: the next :meth:`reduce_gradients` of each optimizer reduces again."""
        self._reduced.clear()

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """The step's gradients reduced (tied weights, the sharding, the axes' hooks), once per optimizer between
        two backwards (Fabric may ask at clipping and again at the step)."""
        if id(optimizer) not in self._reduced:
            reduce_step_gradients(self.applied, self.require_sharding(), optimizer)
            self._reduced.add(id(optimizer))

    def step_closure(
        self, closure: Callable[[], Any], optimizer: Optimizer, arm: Callable[..., None] | None = None
    ) -> Callable[[], Any]:
        """``closure`` (a step's forward and backward, the step's last backward) wrapped so that the sharding reduces
        as the backward goes (``arm(sharding, optimizer)``: a pipeline arms each stage's buckets before its last
        microbatch's backward instead), and the step's gradients are reduced once after it, before clipping."""

        def closure_then_reduce() -> Any:
            sharding = self.require_sharding()
            if arm is None:
                sharding.before_last_backward(optimizer)
            else:
                arm(sharding, optimizer)
            self.new_backward()
            result = closure()
            self.reduce_gradients(optimizer)
            return result

        return closure_then_reduce

    def take_optimizers(self, model: nn.Module, optimizers: list[Optimizer], precision: str) -> None:
        """The sharding takes each of the split ``model``'s ``optimizers`` (Muon's ``precision`` checked first);
        under PowerSGD the embeddings and the weights tied across stages travel whole (both doors, at setup)."""
        sharding = self.require_sharding()
        if sharding.powersgd is not None:
            tied = self.applied.tied if self.applied is not None else None
            sharding.powersgd.keep_whole(embedding_weights(model) + (tied.params() if tied else []))
        for optimizer in optimizers:
            check_muon_precision(optimizer, precision)
            sharding.shard_optimizer(optimizer)

    def clip(self, optimizer: Optimizer, max_norm: float, norm_type: float) -> Tensor:
        """Clip by the norm of the whole model's gradient, however it is split; returns that norm."""
        return clip_model_grad_norm(
            optimizer, max_norm, norm_type, self.applied, self.require_sharding(), self.require_mesh()
        )

    def reduce(self, tensor: Tensor, reduce_op: Any) -> Tensor:
        """A logged value reduced over the ``loss`` role (the ``batch`` ranks, and under cp the ranks holding pieces
        of the same sequences): pipeline stages and tensor shards hold the same values."""
        mesh = self.require_mesh()
        return reduce_in_place(tensor, mesh.group("loss"), mesh.size("loss"), reduce_op)

    # ----- checkpoints -----

    def state_views(self, optimizers: list[Optimizer]) -> list[StateView | None]:
        """How the sharding holds each optimizer's state (None: per parameter)."""
        return [self.require_sharding().state_view(o) for o in optimizers]

    def target(
        self,
        model: nn.Module,
        module: Any,
        optimizers: list[Optimizer],
        rank: int,
        world_size: int,
        checkpointer: Any = None,
    ) -> sharded_checkpoint.CheckpointTarget:
        """What a sharded save or load works on: the door's ``model`` (``module``: the LightningModule, or the model),
        its torch ``optimizers``, this rank, the sharding; ``checkpointer``: the asynchronous saver, if any."""
        return sharded_checkpoint.CheckpointTarget(
            model, module, optimizers, rank, world_size, self.sharding, checkpointer
        )

    def save(self, target: sharded_checkpoint.CheckpointTarget, checkpoint: dict[str, Any], path: Any) -> None:
        """A sharded folder at ``path``: every rank writes what it holds under single-process names (collective)."""
        views = self.state_views(target.optimizers)
        sharded_checkpoint.save(target, checkpoint, path, views, self.full_param_order)

    def load(self, target: sharded_checkpoint.CheckpointTarget, path: Any) -> dict[str, Any]:
        """A sharded folder's states into the target's model and optimizers, in place; the rest of the checkpoint."""
        return sharded_checkpoint.load(target, path, self.state_views(target.optimizers))


def keep_logits_split(module: Any, applied: Parallelized, tp: int) -> None:
    """Under tp without pp, ``module.loss`` takes the logits split over the vocabulary (the one place a module's loss
    is replaced; under pp the door's pipeline runner wraps the loss it calls)."""
    if applied.split is None and tp > 1 and has_loss(module):
        module.loss = vocab_parallel_loss(module.loss)


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
