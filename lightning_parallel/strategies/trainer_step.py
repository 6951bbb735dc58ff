"""One Trainer optimizer step under the mesh strategies, around Lightning's own: the closure whose backward is the
step's last (the sharding reduces as it goes; the runtime reduces the step's gradients once after it), torchft's
path over the replica groups alive now (:mod:`.fault_tolerant_step`), and the contexts a backward runs in.

:class:`~lightning_parallel.strategies.base.MeshStrategy`'s ``optimizer_step`` and ``backward`` are one call each
into these; Fabric's door has no closure (it reduces at clipping or at the step, whichever comes first).

May import: Lightning, ``lightning_parallel.parallel``, ``lightning_parallel.plugins`` and ``.checkpointing``,
``.fault_tolerant_step``, ``.runtime``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from lightning_parallel.parallel.expert.aux import aux_loss_scale
from lightning_parallel.plugins.precision import loss_scale_of
from lightning_parallel.strategies.checkpointing import unwrap_optimizer
from lightning_parallel.strategies.fault_tolerant_step import fault_tolerant_step
from lightning_parallel.strategies.runtime import MeshRuntime


def optimizer_step(
    runtime: MeshRuntime,
    optimizer: Any,
    closure: Callable[[], Any],
    lightning_step: Callable[[Callable[[], Any]], Any],
    pipelined: Any = None,
    replicas: Any = None,
    trainer: Any = None,
) -> Any:
    """Lightning's step (``lightning_step(closure)``) over a closure that reduces the step's gradients; under pp
    (``pipelined``: the module's :class:`~lightning_parallel.strategies.pipelined_step.PipelinedStep`) the schedule
    arms each stage's buckets; under torchft (``replicas``) across the replica groups alive now. Returns the step's
    result."""
    raw = unwrap_optimizer(optimizer)
    arm = pipelined.arm_last_backward if pipelined is not None else None
    closure_then_reduce = runtime.step_closure(closure, raw, arm)
    sharding = runtime.require_sharding()
    if replicas is not None:  # fault_tolerance='torchft': across the replica groups alive now
        grads = lambda: [g for g, _, _ in sharding.grad_pieces(raw)]  # noqa: E731
        result = fault_tolerant_step(replicas, trainer, raw, closure_then_reduce, lightning_step, grads)
    else:
        result = lightning_step(closure_then_reduce)
    sharding.after_step(raw)
    return result


def backward_context(runtime: MeshRuntime, trainer: Any, precision_plugin: Any) -> contextlib.ExitStack:
    """Around an unpipelined backward: MoE auxiliary losses get the gradient the main loss has (fp16 scale, divided
    by the accumulation steps), and under tp the vocabulary-parallel loss its own backward rules."""
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    stack = contextlib.ExitStack()
    stack.enter_context(aux_loss_scale(loss_scale_of(precision_plugin) / accumulate))
    stack.enter_context(runtime.loss_context())
    return stack
