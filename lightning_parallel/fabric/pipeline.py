"""Pipeline parallelism under Fabric: one explicit call runs a batch's forward and backward.

Under pp > 1 no rank holds the whole model, so ``model(x)`` cannot return logits and ``fabric.backward`` has no
graph to walk. A Fabric loop calls :meth:`MeshFabricStrategy.pipeline_step
<lightning_parallel.fabric.strategy.MeshFabricStrategy.pipeline_step>` instead: it cuts the batch into the
configured microbatches and runs every microbatch's forward and backward under the configured schedule
(:class:`~lightning_parallel.parallel.pipeline.runner.Pipeline`, the Trainer's runner), adding the gradients of
``loss * scale`` to the stage parameters as ``fabric.backward(loss * scale)`` would. Without pp the same call is a
forward, the loss and ``fabric.backward``: a loop written with it runs under every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel

from lightning_parallel.parallel.pipeline.runner import Pipeline
from lightning_parallel.parallel.pipeline.split import PipelineSplit
from lightning_parallel.parallel.tensor.loss import full_loss, vocab_parallel_loss
from lightning_parallel.plugins.precision import loss_scale_of

LossFn = Callable[[Any, Any], Tensor]


def build_pipeline(strategy: Any, module: nn.Module, split: PipelineSplit) -> Pipeline:
    """This rank's stages under ``strategy``'s schedule and microbatches; the loss is set at each step."""
    config = strategy.config
    loss = getattr(module, "loss", None)
    return Pipeline(
        split, config.pp_schedule, config.microbatches, strategy.mesh.group("stage"), strategy.root_device, loss
    )


def as_inputs(inputs: Any) -> tuple:
    """The positional inputs of the model: a tuple or list as it is, anything else as the only one."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def loss_of(module: nn.Module, loss_fn: LossFn | None, owner: str) -> LossFn:
    """``loss_fn``, or the module's own ``loss(output, target)``; a TypeError naming the call when neither."""
    if loss_fn is not None:
        return loss_fn
    loss = getattr(module, "loss", None)
    if not callable(loss):
        raise TypeError(
            f"{owner}.pipeline_step: {type(module).__name__} has no loss(output, target): pass "
            "loss_fn=lambda output, target: ... (a mean over the microbatch's samples)."
        )
    return loss


def pipelined_loss(
    strategy: Any, pipeline: Pipeline, inputs: tuple, kwargs: dict, target: Any, loss_fn: LossFn, scale: float
) -> Tensor:
    """Forward and backward of every microbatch under the schedule; the batch loss on every pp rank."""
    tp = strategy.parallel_dims.tp > 1
    # under tp the whole schedule runs in one loss_parallel context (its backward needs the rules too)
    pipeline.loss_fn = full_loss(loss_fn) if tp else loss_fn
    context = loss_parallel() if tp else contextlib.nullcontext()
    inputs, kwargs = strategy.precision.convert_input((inputs, kwargs))
    with context, strategy.precision.forward_context():
        # fp16: the schedule backpropagates the loss times the current scale (as the precision's pre_backward would)
        return pipeline.train_step(inputs, kwargs, target, loss_scale=scale * loss_scale_of(strategy.precision))


def unpipelined_loss(
    strategy: Any, module: nn.Module, inputs: tuple, kwargs: dict, target: Any, loss_fn: LossFn | None, scale: float
) -> Tensor:
    """The same call without pp: forward, loss, ``backward(loss * scale)``; the loss (detached)."""
    loss = loss_of(module, loss_fn, type(strategy).__name__)
    if loss_fn is not None and strategy.parallel_dims.tp > 1:
        loss = vocab_parallel_loss(loss)  # the module's own loss is wrapped at setup already
    inputs, kwargs = strategy.precision.convert_input((inputs, kwargs))
    with strategy.precision.forward_context():  # the module itself: Fabric's wrapper would ask for fabric.backward
        output = strategy.precision.convert_output(module(*inputs, **kwargs))
    value = loss(output, target)
    strategy.backward(value * scale if scale != 1 else value, module)
    return value.detach()
