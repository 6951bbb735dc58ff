"""AsyncPSStrategy: asynchronous (or stale-synchronous, or synchronous) parameter-server training.

The last ``num_servers`` ranks are parameter servers, the others workers (rank 0 is a worker, so Lightning's
rank-zero logging and checkpointing happen on a worker). The pure-torch pieces are in
``lightning_parallel.parallel.async_ps``; this class wires them into Lightning's fit:

- every rank builds the model and the optimizer of ``configure_optimizers``; a server then runs that
  optimizer's class and group settings on its shard of the flat parameters (the optimizer states live there);
- a server enters its serving loop in ``on_train_start`` and returns when every worker is done or dead, then
  stops its (empty) training loop: servers never see a batch;
- a worker pulls the parameters before each step's forward, pushes its gradient after backward, and pulls again
  before validation and at the end of training; its Lightning collectives (barrier, broadcast, the reduce of
  ``sync_dist`` metrics during validation) run over the live workers through server 0; a training-time
  ``sync_dist`` log is this worker's own value (a collective per step would tie the workers together);
- rank 0 saves checkpoints that hold the servers' shards, optimizer states and update counter; the
  ``state_dict`` is the whole model (the servers' parameters), loadable in one process.

May import: Lightning, ``lightning_parallel.parallel``, ``lightning_parallel._compat`` and ``.launcher``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.parallel.async_ps import protocol
from lightning_parallel.parallel.async_ps.client import ServerClient, grad_norm
from lightning_parallel.parallel.async_ps.layout import FlatLayout, check_optimizer
from lightning_parallel.parallel.async_ps.server import Clip, ParameterServer
from lightning_parallel.parallel.failure import to_timeout
from lightning_parallel.parallel.shutdown import release_at_exit
from lightning_parallel.strategies.distributed import set_world_ranks
from lightning_parallel.strategies.launcher import CheckFirstLauncher
from lightning_parallel.strategies.worker_collectives import WorkerCollectives, local_sigterm_check


class AsyncPSStrategy(WorkerCollectives, ParallelStrategy):
    """Parameter servers on the last ``num_servers`` ranks, workers on the others.

    Args:
        num_servers: ranks that hold the parameters and optimizer states (a contiguous shard each).
        staleness: 0: synchronous (each server averages the step's pushes of every live worker, then one
            optimizer step: the same training as one process on the global batch); ``s > 0``: every push is
            applied as it comes (one update per push), and no worker runs more than ``s`` steps ahead of the
            slowest (stale-synchronous); a staleness above ``max_steps`` is fully asynchronous.
        slow_worker_sleep: seconds one worker sleeps in every step (a slowed worker, for tests and benchmarks).
        slow_worker_rank: which worker sleeps (global rank; None: the last worker).
        timeout: a ``timedelta`` or seconds: torch's collectives at start-up, and how long a server waits for a
            worker to connect before counting it as dead.
        accelerator: Lightning's (as are ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin`` and ``process_group_backend``).
    """

    strategy_name = "async_ps"

    def __init__(
        self,
        num_servers: int = 1,
        staleness: int = 0,
        slow_worker_sleep: float = 0.0,
        slow_worker_rank: int | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
    ) -> None:
        protocol.check_settings(num_servers, staleness, slow_worker_sleep)
        if slow_worker_rank is not None and (
            isinstance(slow_worker_rank, bool) or not isinstance(slow_worker_rank, int)
        ):
            raise ValueError(
                f"slow_worker_rank={slow_worker_rank!r} must be a worker's global rank, or None (the last)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_servers, self.staleness = num_servers, staleness
        self.slow_worker_sleep, self.slow_worker_rank = float(slow_worker_sleep), slow_worker_rank
        self._process_group_backend = process_group_backend
        self._timeout = to_timeout(default_pg_timeout if timeout is None else timeout)
        self.num_nodes = 1
        self._layout: FlatLayout | None = None
        self._server: ParameterServer | None = None
        self._client: ServerClient | None = None
        self._server_group: Any = None
        self._serving = False  # servers serve, workers' collectives go through server 0
        self._snapshot: tuple[int, list[dict[str, Any]]] | None = None
        self.counters: list[dict[str, Any]] | None = None  # rank 0, after fit: each server's counters

    # ----- ranks -----

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def num_workers(self) -> int:
        return protocol.check_world(self.num_servers, self.world_size)

    @property
    def is_server(self) -> bool:
        return protocol.is_server(self.global_rank, self.world_size, self.num_servers)

    @property
    def slow_rank(self) -> int | None:
        if not self.slow_worker_sleep:
            return None
        return self.num_workers - 1 if self.slow_worker_rank is None else self.slow_worker_rank

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the global batch is split over the workers; a server's loader is never iterated
        return {"num_replicas": self.num_workers, "rank": 0 if self.is_server else self.global_rank}

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    # ----- checks, before any process group -----

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        world = self.num_nodes * self.num_processes
        workers = protocol.check_world(self.num_servers, world, "num_servers")
        if self.slow_worker_rank is not None and not 0 <= self.slow_worker_rank < workers:
            raise ValueError(
                f"slow_worker_rank={self.slow_worker_rank} is not a worker: workers are ranks 0..{workers - 1} "
                f"(the last {self.num_servers} of {world} serve); pick one of them or None (the last worker)."
            )
        self._check_precision()
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = CheckFirstLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def _check_precision(self) -> None:
        plugin = self._precision_plugin
        if plugin is None or type(plugin) is Precision:
            return
        if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
            return
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"precision={name!r} is not supported by strategy='async_ps': the servers keep fp32 parameters and apply "
            "each gradient as it comes, with no loss scaling; use precision='32-true' or 'bf16-mixed'."
        )

    def check_model(self, model: Any) -> None:
        """Refuse Trainer settings this strategy cannot honour (the launcher calls it before starting ranks)."""
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            return
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by strategy='async_ps' "
                "(a push is one batch's gradient): set accumulate_grad_batches=1 and raise the batch size instead."
            )
        if not model.automatic_optimization:
            raise ValueError(
                "automatic_optimization=False is not supported by strategy='async_ps': the servers run the "
                "optimizer; use automatic optimization (return the loss from training_step)."
            )

    @override
    def connect(self, model: Any) -> None:
        self.check_model(model)
        super().connect(model)

    # ----- process group, model, servers -----

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _compat.default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        _compat.init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        release_at_exit()  # the groups go before the interpreter does: a finished run exits 0
        if self.num_servers > 1:  # every rank joins new_group; only servers use it (a synchronous step's norm)
            first = self.world_size - self.num_servers
            self._server_group = dist.new_group(list(range(first, self.world_size)), timeout=self._timeout)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"strategy='async_ps' runs one optimizer on the servers; configure_optimizers returned "
                    f"{len(self.optimizers)}: return one optimizer (with param groups if settings differ)."
                )
            check_optimizer(self.optimizers[0])
            self._layout = FlatLayout.of(self.optimizers[0], self.num_servers)
            self._start_servers_or_connect(trainer)
        self.setup_precision_plugin()

    def _start_servers_or_connect(self, trainer: Any) -> None:
        assert self._layout is not None
        store = _compat.default_store()
        server = self.global_rank - self.num_workers
        if self.is_server:
            clip = None
            if trainer.gradient_clip_val:
                algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm))
                clip = Clip(float(trainer.gradient_clip_val), algorithm or "norm")
            self._server = ParameterServer(
                self._layout,
                self.optimizers[0],
                server,
                list(range(self.num_workers)),
                self.staleness,
                clip=clip,
                server_group=self._server_group,
                register_timeout_s=self._timeout.total_seconds(),
            )
            host = _host()
            port = self._server.listen("127.0.0.1" if host == "127.0.0.1" else "")
            protocol.publish_address(store, server, host, port)
        else:
            addresses = [protocol.server_address(store, i) for i in range(self.num_servers)]
            self._client = ServerClient(addresses, self.global_rank, self._layout, self._timeout.total_seconds())

    # ----- the serving loop and the workers' steps -----

    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        self._serving = True
        if self._server is not None:
            self.counters = [self._server.serve()]
            trainer.should_stop = True  # a server's own training loop ends before its first batch
        elif self._client is not None:
            local_sigterm_check(trainer)
            self._client.hello(trainer.global_step)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self._client is not None and self._layout is not None, "servers run no training step"
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        self._client.pull(step)  # before the closure: it runs training_step's forward, then backward
        loss = closure()
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if self.global_rank == self.slow_rank:
            time.sleep(self.slow_worker_sleep)
        flat = self._layout.flat_grads()
        # an asynchronous update is one push: its clipping norm is this whole gradient's (servers hold slices)
        norm = grad_norm(flat) if self.staleness and trainer.gradient_clip_val else None
        # the step's loss on this worker's share (Lightning's closure divides it by the accumulation): the servers
        # average the workers' into the global training loss, with no collective of their own
        local = float(loss) * trainer.accumulate_grad_batches if loss is not None else None
        self._client.push(step, flat, [float(g["lr"]) for g in optimizer.param_groups], norm, local)
        return loss

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if self._client is not None and self._serving:
            # the parameters a next step would use; after a local stop (should_stop: a time budget, early
            # stopping) workers validate at different steps, and waiting for the others' pushes could deadlock
            # with their validation's collectives: then the newest parameters the servers have
            self._client.pull(-(2**62) if trainer.should_stop else trainer.global_step)

    @override
    def on_train_end(self) -> None:
        if self._client is None or not self._serving:
            return
        # finished first: a worker that stopped early (a time budget, should_stop) must not hold the others, whose
        # pulls would wait for its clock while its own final pull waits for theirs
        self._client.finish()
        self._client.pull(self.lightning_module.trainer.global_step)  # the final parameters
        if self.global_rank == 0:
            self.counters = self._client.counters()

    @override
    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._serving = False
        super().teardown()

    # ----- checkpoints: rank 0 saves the servers' shards -----

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the servers exist when their shards load

    def _servers_state(self) -> list[dict[str, Any]] | None:
        """On rank 0 while serving: every server's state at this step (fetched once per step)."""
        if not (self._over_workers() and self.global_rank == 0):
            return None
        step = self.lightning_module.trainer.global_step
        if self._snapshot is None or self._snapshot[0] != step:
            self._snapshot = (step, self._client.snapshot(step))
        return self._snapshot[1]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        servers = self._servers_state()
        if servers is None or self._layout is None:
            return state
        flat = torch.cat([torch.cat([p.reshape(-1) for p in s["pieces"]]) for s in servers])
        names = self._layout.names(self.lightning_module)
        for name, param, offset in zip(names, self._layout.params, self._layout.offsets):
            state[name] = flat[offset : offset + param.numel()].view_as(param).to(state[name].dtype).clone()
        return state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        servers = self._servers_state()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if servers is None:
            return {"param_groups": groups}
        return {"param_groups": groups, "async_ps": {"num_servers": self.num_servers, "servers": servers}}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        (state,) = checkpoint["optimizer_states"][:1] or [{}]
        saved = state.get("async_ps")
        if saved is None:
            raise ValueError(
                "this checkpoint has no parameter-server state (it was not saved under strategy='async_ps' while "
                "training): resume it with the strategy that saved it, or load only its weights."
            )
        if saved["num_servers"] != self.num_servers:
            raise ValueError(
                f"the checkpoint was saved with num_servers={saved['num_servers']}, this run has "
                f"num_servers={self.num_servers}: resume with num_servers={saved['num_servers']}."
            )
        if self._server is not None:
            self._server.load_state_dict(saved["servers"][self._server.server])
        for group, hyper in zip(self.optimizers[0].param_groups, state["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})


def _host() -> str:
    """The address workers reach this server at: MASTER_ADDR's interface on one node, this host otherwise."""
    import os
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())
