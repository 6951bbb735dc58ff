"""Lets a LightningModule's own steps drive a pipeline schedule, unchanged.

Under pp > 1 no rank holds the whole model, so ``self(x)`` cannot return logits. Instead it returns a
:class:`PipelineInput` that remembers ``x``, and ``self.loss(output, target)`` runs the schedule:

- in training (gradients enabled): forward and backward of every microbatch happen inside the step,
  because the schedule interleaves them. Lightning then zeroes gradients (first batch of an accumulation
  window) and calls backward; so the fresh gradients are set aside here and added back when the strategy's
  backward runs, exactly where plain autograd would have produced them;
- in validation and test: forward only, the loss reduced to every pp rank;
- anything else done with the output (``argmax`` in a predict step) runs the forward pipeline and hands
  every rank the whole output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_parallel._compat import attached_trainer
from lightning_parallel.parallel.pipeline.runner import Pipeline
from lightning_parallel.parallel.pipeline.split import PipelineSplit
from lightning_parallel.parallel.tensor.loss import full_loss
from lightning_parallel.plugins.precision import loss_scale_of

_TRAINING_USE = (
    "Under pp > 1 the training step must pass the output of self(...) straight to self.loss(output, target): "
    "the pipeline computes the loss on its last stage and runs the backward there. Compute anything else "
    "inside loss(), or log it from validation_step."
)


class PipelineInput:
    """What ``self(...)`` returns under pp > 1: the inputs of a pipeline run not yet made."""

    def __init__(self, runner: PipelinedStep, args: tuple, kwargs: dict) -> None:
        self._runner, self._args, self._kwargs = runner, args, kwargs

    def materialize(self) -> Any:
        if torch.is_grad_enabled():
            raise TypeError(_TRAINING_USE)
        return self._runner.pipeline.forward(self._args, self._kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, PipelineInput) else x

        return func(*[real(a) for a in args], **{k: real(v) for k, v in (kwargs or {}).items()})


class PipelinedStep:
    """Patches ``module.forward`` and ``module.loss`` so the module's steps run ``pipeline``.

    Args:
        module: the LightningModule (already split: it holds only this rank's stages).
        pipeline: this rank's stages and schedule; its loss function is the module's original ``loss``.
        params: the parameters of this rank's stages.
        context: entered around every schedule run (the vocabulary-parallel loss context under tp).
        loss_scale: the current fp16 loss scale (the schedule backpropagates the scaled loss, as
            ``loss.backward()`` would after the precision plugin's ``pre_backward``); 1 by default.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        pipeline: Pipeline,
        params: list[nn.Parameter],
        context: Callable[[], Any],
        loss_scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.module, self.pipeline, self.params, self.context = module, pipeline, params, context
        self.loss_scale = loss_scale
        self.original_loss = module.loss
        self._pending: list[Tensor | None] | None = None
        # overlap_grad_reduce: each stage's parameters (tied ones left out: they meet over pp first), armed just
        # before the stage's last microbatch's backward; the gradients set aside are added in by _merge_earlier
        self.stage_params: dict[int, list[nn.Parameter]] = {}
        self._position = {id(p): i for i, p in enumerate(params)}
        self._arm_stage: Callable[[list[nn.Parameter], bool], None] | None = None
        self._earlier: list[Tensor | None] = []
        self._window_open = False  # gradients of earlier micro-steps of this accumulation window were applied
        self._last_of_window = False
        module.forward = self.capture
        module.loss = self.loss

    def capture(self, *args: Any, **kwargs: Any) -> PipelineInput:
        return PipelineInput(self, args, kwargs)

    def loss(self, output: Any, target: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not isinstance(output, PipelineInput):
            return self.original_loss(output, target, *args, **kwargs)
        if args or kwargs:
            raise TypeError("Under pp > 1, loss(output, target) takes no further arguments: fold them into loss().")
        with self.context():
            if torch.is_grad_enabled():
                return self._train(output, target)
            return self.pipeline.eval_loss(output._args, output._kwargs, target)

    def _train(self, output: PipelineInput, target: Any) -> Tensor:
        if self._pending is not None:
            raise RuntimeError(
                "Under pp > 1 each training step runs the pipeline once: call self.loss(self(x), y) once per step."
            )
        trainer = attached_trainer(self.module)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        self._earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        arm, self._arm_stage = self._arm_stage, None
        self._last_of_window = arm is not None
        if arm is not None:
            self.pipeline.on_last_backward = lambda index, done: arm(self.stage_params.get(index, []), done)
        try:
            # the returned loss is unscaled: the pipeline keeps each microbatch's loss before scaling
            scale = self.loss_scale() / accumulate
            loss = self.pipeline.train_step(output._args, output._kwargs, target, loss_scale=scale)
            self._pending = [p.grad for p in self.params]
        finally:
            self.pipeline.on_last_backward = None
            for p, grad in zip(self.params, self._earlier):
                p.grad = grad
            self._earlier = []
        return loss

    def arm_last_backward(self, sharding: Any, optimizer: Any) -> None:
        """The coming training step is the optimizer step's last micro-step: the data-parallel ``sharding``
        (overlap_grad_reduce; a no-op without it) arms each stage's parameters just before that stage's last
        microbatch's weight-gradient backward, and takes those still waiting as complete right after it."""
        sharding.before_last_backward(optimizer, only=[], prepare=self._merge_earlier)
        self._arm_stage = lambda params, done: sharding.arm_more(optimizer, params, ready=done)

    def _merge_earlier(self, p: nn.Parameter) -> None:
        """A gradient complete for this schedule (inside its backward): add the earlier micro-steps' gradients
        now, as apply_gradients would after the schedule, so the bucket travels the step's whole gradient."""
        i = self._position[id(p)]
        earlier = self._earlier[i] if self._window_open else None  # else stale: the window's zero_grad drops it
        self._earlier[i] = None  # taken: apply_gradients finds the sum alone
        p.grad = add_gradient(earlier, p.grad)

    def hand_over(self, strategy: Any, closure_loss: Tensor) -> Tensor:
        """The Trainer door's ``backward`` under pp: the schedule ran forward and backward inside the training step;
        its gradients are added with the strategy's and its precision plugin's hooks around, as a backward would."""
        plugin = strategy.precision_plugin
        strategy.pre_backward(closure_loss)
        closure_loss = plugin.pre_backward(closure_loss, self.module)
        self.apply_gradients()
        closure_loss = plugin.post_backward(closure_loss, self.module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def apply_gradients(self) -> None:
        """Add the gradients the last training step computed (what ``loss.backward()`` would have done)."""
        if self._pending is None:
            raise RuntimeError("Under pp > 1 backward needs a loss from self.loss(self(x), y) in the training step.")
        for p, fresh in zip(self.params, self._pending):
            p.grad = add_gradient(p.grad, fresh)
        self._pending = None
        self._window_open = not self._last_of_window  # the step closes the accumulation window


def add_gradient(earlier: Tensor | None, fresh: Tensor | None) -> Tensor | None:
    """``earlier + fresh`` as gradient accumulation adds them (None counts as nothing)."""
    if fresh is None or earlier is None:
        return earlier if fresh is None else fresh
    if isinstance(earlier, DTensor):
        return earlier + fresh  # DTensor addition also reconciles differing placements
    return earlier.add_(fresh)  # in place: the gradient may be a view into a ZeRO flat buffer


def pipelined_step(strategy: Any, module: pl.LightningModule, split: PipelineSplit, tp: bool) -> PipelinedStep:
    """Wire ``module``'s steps to a pipeline over this rank's stages under ``strategy``'s schedule."""
    config = strategy.config
    # under tp the whole schedule runs in one loss_parallel context: its backward needs the rules too, and a
    # nested context would switch them off on exit
    loss_fn = full_loss(module.loss) if tp else module.loss
    pipeline = Pipeline(
        split, config.pp_schedule, config.microbatches, strategy.mesh.group("stage"), strategy.root_device, loss_fn
    )
    context = loss_parallel if tp else contextlib.nullcontext
    # fp16: the schedule backpropagates the loss times the current scale (the plugin's pre_backward cannot)
    step = PipelinedStep(
        module, pipeline, split.parameters(), context, lambda: loss_scale_of(strategy.precision_plugin)
    )
    applied = strategy.runtime.applied
    tied = applied.tied if applied is not None else None
    shared = {id(p) for p in tied.params()} if tied is not None else set()  # reduced over pp after the schedule
    step.stage_params = {i: [p for p in m.parameters() if id(p) not in shared] for i, m in split.stages.items()}
    return step
