"""The Lightning collectives of :class:`~lightning_parallel.strategies.async_ps.AsyncPSStrategy`: over the whole
world before the servers start serving (every rank is still in Lightning's setup), over the live workers
through server 0 while they serve (``ServerClient.collective``), and local on a server once it has served.
Mixed into the strategy, which sets ``_serving`` and ``_client``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from typing_extensions import override

from lightning_parallel import _compat


class WorkerCollectives:
    _serving: bool
    _client: Any

    def _over_workers(self) -> bool:
        return self._serving and self._client is not None

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._over_workers():
            self._client.collective("barrier")
        elif not self._serving and _compat.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._over_workers():
            return self._client.collective("broadcast", obj, src)
        if self._serving or not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        if self._over_workers():
            trainer = self.lightning_module.trainer
            if trainer.state.stage == RunningStage.TRAINING:
                return tensor  # this worker's value: a collective per logged step would lock the workers together
            op = str(reduce_op).lower().split(".")[-1]
            op = "mean" if op in ("mean", "avg") else op
            return self._client.collective(op, tensor).to(tensor.device)
        if self._serving:
            return tensor
        return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._over_workers():
            votes = self._client.collective("min" if all else "max", torch.tensor(float(decision)))
            return bool(votes)
        if self._serving or not _compat.distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self._serving:
            raise RuntimeError(
                "all_gather is not available under strategy='async_ps' during training (workers run at their own "
                "pace and may die): log with self.log(..., sync_dist=True) instead."
            )
        return super().all_gather(tensor, group, sync_grads)


def local_sigterm_check(trainer: Any) -> None:
    """Lightning 2.6 broadcasts a SIGTERM flag from rank 0 over the whole world before every training batch
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``): the servers are not in a loop to join it, and a dead
    worker would fail it. Each worker checks its own flag instead (on this instance only)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return

    def check_own_flag() -> None:
        if getattr(trainer, "received_sigterm", False):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = check_own_flag
