"""The Trainer's side of ``fault_tolerance='torchft'``: one optimizer step over the replica groups alive now.

:class:`~lightning_parallel.parallel.fault_tolerance.FaultTolerantReplicas` does the torchft work; here it meets
Lightning: the quorum before the step's forward, the cross-group average after the strategy's own reduction, the
update applied only when torchft commits, and the Trainer's step count kept equal to torchft's committed steps (a
dropped step runs again; a rejoined group continues from its peers' count, so every group stops at max_steps).

May import: Lightning, ``lightning_parallel.parallel``, ``.checkpointing``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.fault_tolerance import FaultTolerantReplicas
from lightning_parallel.strategies.checkpointing import unwrap_optimizer


def start_replicas(strategy: Any, trainer: Any) -> FaultTolerantReplicas | None:
    """This rank's torchft handle when the strategy's config asks for it (after the optimizers are set up).

    Raises:
        ValueError: gradient accumulation (a rejoining group would load state between a step's microbatches).
    """
    if strategy.config.fault_tolerance != "torchft":
        return None
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"fault_tolerance='torchft' with accumulate_grad_batches={trainer.accumulate_grad_batches}: a rejoining "
            "replica group loads its peers' state at the start of a step. Set accumulate_grad_batches=1."
        )
    optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]

    def state_dict() -> dict[str, Any]:
        # this rank's pieces only (tp, ZeRO-3: DTensors' local shards; the peer of the same group rank holds the
        # same ones); the optimizers' parameters travel too: under ZeRO-1/2 they are flat slices, not the module's
        params = [[local(p) for g in o.param_groups for p in g["params"]] for o in optimizers]
        return {
            "model": {name: local(t) for name, t in strategy.model.state_dict().items()},
            "optimizers": [o.state_dict() for o in optimizers],
            "params": params,
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        with torch.no_grad():  # a module's state_dict tensors share storage with its parameters and buffers
            for name, t in strategy.model.state_dict().items():
                local(t).copy_(state["model"][name])
        for optimizer, saved, params in zip(optimizers, state["optimizers"], state["params"], strict=True):
            optimizer.load_state_dict(saved)
            with torch.no_grad():
                for p, value in zip((p for g in optimizer.param_groups for p in g["params"]), params, strict=True):
                    local(p).copy_(value)

    env = strategy.cluster_environment
    return FaultTolerantReplicas(
        strategy.config,
        strategy.root_device,
        state_dict,
        load_state_dict,
        group_rank=strategy.global_rank,
        group_size=strategy.world_size,
        store=(env.main_address, env.main_port),
    )


def fault_tolerant_step(
    replicas: FaultTolerantReplicas,
    trainer: Any,
    optimizer: Optimizer,
    closure: Callable[[], Any],
    apply_update: Callable[[Callable[[], Any]], Any],
    grads: Callable[[], list[torch.Tensor]],
) -> Any:
    """One step: quorum (a rejoining group loads a peer's state here), forward and backward and the in-group
    reduction (``closure``), the cross-group average of ``grads()``, then ``apply_update`` only if torchft commits.

    Args:
        replicas: this rank's torchft handle.
        trainer: the Trainer (its step count follows torchft's).
        optimizer: the torch optimizer.
        closure: the step's forward, backward and in-group reduction.
        apply_update: the strategy's optimizer step, given a closure that returns the step's result.
        grads: this rank's gradient pieces, after the in-group reduction.
    """
    replicas.start_step()
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    progress.ready = progress.completed = replicas.step  # the step this forward runs (a rejoined group: its peers')
    result = closure()
    replicas.reduce(grads())
    if replicas.should_commit():
        apply_update(lambda: result)
    else:  # a peer died mid-step: drop the update; the same step runs again with the next quorum
        optimizer.zero_grad(set_to_none=True)
    # Lightning adds one after this returns: the count lands on torchft's committed steps
    progress.ready = progress.completed = replicas.step - 1
    return result
