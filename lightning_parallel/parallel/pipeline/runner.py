"""Running this rank's pipeline stages under a ``torch.distributed.pipelining`` schedule. Pure torch.

What torch leaves to us, and this module adds: one schedule per input shape and mode (torch infers stage shapes
once per schedule); forward-only passes outside the schedules (zero-bubble schedules run backward actions even
in eval); the pipeline loss (it exists on the last stage only) reduced to every pp rank, so logs and checkpoint
callbacks see the same value everywhere; stage shape inference that leaves BatchNorm statistics alone; and the
timeline hooks of :mod:`lightning_parallel.parallel.measure.timeline`. The schedule itself comes from the table in
:mod:`lightning_parallel.parallel.pipeline.schedules`.

Keyword inputs of the step (``self(x, attention_mask=..., position_ids=...)``) are not arguments of the first
layer: torch cuts them into microbatches as it cuts ``x`` and hands each stage its microbatch's, which the layers
of every stage read with :func:`stage_inputs` (what a padding mask or packed position ids need at each stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import ShapeInferenceHookStage
from lightning_parallel.parallel import strict
from lightning_parallel.parallel.expert.aux import aux_loss_scale
from lightning_parallel.parallel.expert.moe import moe_layers
from lightning_parallel.parallel.measure.timeline import active_recorder
from lightning_parallel.parallel.pipeline.schedules import schedule_spec
from lightning_parallel.parallel.pipeline.split import PipelineSplit

_STAGE_INPUTS: ContextVar[dict[str, Any]] = ContextVar("stage_inputs", default={})  # noqa: B039  (never mutated)


_CHUNK: ContextVar[int | None] = ContextVar("pipeline_chunk", default=None)


def scheduled_chunk() -> int | None:
    """The microbatch whose forward the running pipeline stage computes inside a schedule's step (None elsewhere:
    shape inference, forward-only walks): for layers that exchange something per microbatch beside the schedule."""
    return _CHUNK.get()


def stage_inputs() -> dict[str, Any]:
    """The keyword inputs of the microbatch the running pipeline stage computes: the step's ``self(x, **kwargs)``
    keyword arguments, cut into microbatches as ``x`` is (the whole batch in forward-only runs). Empty outside a
    pipeline run. Layers that need more than the previous stage's output (an attention mask, position ids) read
    them here, on every stage."""
    return _STAGE_INPUTS.get()


@contextlib.contextmanager
def _inputs_of_stage(inputs: dict[str, Any] | None) -> Iterator[None]:
    token = _STAGE_INPUTS.set(dict(inputs or {}))
    try:
        yield
    finally:
        _STAGE_INPUTS.reset(token)


class _Stage(ShapeInferenceHookStage):
    """A ``PipelineStage`` whose shape inference leaves running statistics alone.

    To learn shapes, torch runs each stage once in train mode on placeholder inputs (uninitialized memory
    on every stage but the first); BatchNorm would fold that run into its running statistics (NaN seen).
    The buffers are restored right after, and MoE layers forget the tokens they counted. While a
    ``pipeline_timeline.TimelineRecorder`` is active, every forward and backward of a microbatch is timed.
    With one stage per rank, each receive is posted one microbatch early (``early_receives``). The step's keyword
    inputs reach the layers as :func:`stage_inputs` in forward, never as arguments of the stage (activation
    checkpointing recomputes a layer from what its pre-hooks made of them, outside the recomputed region).
    """

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        self._buffers_before = [b.detach().clone() for b in submodule.buffers()]

    def _prepare_forward_infra(
        self, num_microbatches: int, args: Any, kwargs: Any = None, *rest: Any, **kw: Any
    ) -> Any:
        with _inputs_of_stage(kwargs):  # shape inference runs the layers too
            return super()._prepare_forward_infra(num_microbatches, args, None, *rest, **kw)

    def after_shape_inference(self) -> None:  # torch's hook, by version: _compat.PIPELINE_STAGE_SHAPE_CLEANUP
        with torch.no_grad():
            for buffer, before in zip(self.submod.buffers(), self._buffers_before):
                buffer.copy_(before)
        self._buffers_before = []
        for layer in moe_layers(self.submod).values():  # nor the experts' token counts
            layer.forget_last()

    # Receives posted one microbatch early (Pipeline turns it on where one stage runs per rank). gloo's TCP send
    # waits until the receiver has posted its receive; torch posts each just before waiting for it, so every
    # transfer cost a notification's round trip more on the critical path. Only where a pair of ranks carries
    # one kind of message in microbatch order (GPipe, 1F1B): messages are matched in the order they are posted.
    early_receives = 0  # the step's microbatch count while on; 0: off
    _early: dict[tuple[str, int], list[dist.Work]]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.early_receives:
            return super().get_fwd_recv_ops(fwd_chunk_id)
        self._post_early("F", fwd_chunk_id, super().get_fwd_recv_ops)
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.early_receives:
            return super().get_bwd_recv_ops(bwd_chunk_id)
        self._post_early("B", bwd_chunk_id, super().get_bwd_recv_ops)
        return []

    def _post_early(self, kind: str, chunk: int, ops_of: Callable[[int], list[dist.P2POp]]) -> None:
        """This microbatch's receives, unless posted already, and the next microbatch's (within the step)."""
        early = self.__dict__.setdefault("_early", {})
        for index in (chunk, chunk + 1):
            if index < self.early_receives and (kind, index) not in early:
                early[(kind, index)] = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops_of(index)]

    def _wait_early(self, kind: str, chunk: int) -> None:
        works = self.__dict__.get("_early", {}).pop((kind, chunk), None)
        if not works:
            return
        recorder = active_recorder()
        with recorder.action("wait", -1, -1) if recorder is not None else contextlib.nullcontext():
            for work in works:
                work.wait()

    # Timeline hook: each action is timed while a TimelineRecorder is active (one None check otherwise).
    def forward_one_chunk(self, fwd_chunk_id: int, args: Any, kwargs: Any = None, *rest: Any, **more: Any) -> Any:
        self._wait_early("F", fwd_chunk_id)
        recorder = active_recorder()
        token = _CHUNK.set(fwd_chunk_id)
        try:
            with _inputs_of_stage(kwargs):
                if recorder is None:
                    return super().forward_one_chunk(fwd_chunk_id, args, None, *rest, **more)
                with recorder.action("F", self.stage_index, fwd_chunk_id):
                    return super().forward_one_chunk(fwd_chunk_id, args, None, *rest, **more)
        finally:
            _CHUNK.reset(token)

    # Set by Pipeline: called with (stage index, False) just before the backward that completes the stage's weight
    # gradients for the step (torch's ``last_backward``: the last microbatch's full or weight-only backward), and
    # with (stage index, True) right after it (a weight-only backward assigns .grad without autograd's hooks).
    on_last_backward: Callable[[int, bool], None] | None = None

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kwargs: Any) -> Any:
        self._wait_early("B", bwd_chunk_id)
        last = full_backward and kwargs.get("last_backward") and self.on_last_backward is not None
        if last:
            self.on_last_backward(self.stage_index, False)
        recorder = active_recorder()
        if recorder is None:
            done = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, **kwargs)
        else:
            with recorder.action("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
                done = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, **kwargs)
        if last:
            self.on_last_backward(self.stage_index, True)
        return done

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        last = kwargs.get("last_backward") and self.on_last_backward is not None
        if last:
            self.on_last_backward(self.stage_index, False)
        recorder = active_recorder()
        if recorder is None:
            done = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        else:
            with recorder.action("W", self.stage_index, bwd_chunk_id):
                done = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        if last:
            self.on_last_backward(self.stage_index, True)
        return done


def early_receives(schedule: str, group: dist.ProcessGroup | str) -> bool:
    """Whether a schedule's stages post their receives one microbatch early over ``group`` (a group or a backend
    name): only on gloo, whose TCP send waits for the receiver's posted receive, and only where one stage runs per
    rank (each pair of ranks carries activations one way and gradients the other, matched in posting order).

    Never on NCCL: there every message between two ranks runs in issue order on one stream, so a receive queued
    ahead of a send the peer is waiting for deadlocks (1F1B at pp=2: rank 0 would queue the backward receives of
    microbatches 0 and 1 before the forward send of microbatch 1 that rank 1 waits in).
    Nor under strict mode (``LP_STRICT_COLLECTIVES``): it keeps NCCL's order on gloo, and rejects this one.
    """
    backend = group if isinstance(group, str) else dist.get_backend(group)
    return str(backend) == "gloo" and schedule_spec(schedule).fixed_stages == 1 and not strict.enabled()


def _signature(args: tuple, kwargs: dict, target: Any) -> tuple:
    def sig(x: Any) -> Any:
        return (tuple(x.shape), x.dtype) if isinstance(x, Tensor) else type(x).__name__

    return tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in sorted(kwargs.items())), sig(target)


class Pipeline:
    """Runs this rank's stages under one schedule for whole batches: train steps, eval losses, outputs.

    Args:
        split: this rank's stages.
        schedule: a ``pp_schedule`` name (:data:`~lightning_parallel.parallel.pipeline.schedules.SCHEDULES`).
        microbatches: microbatches each batch is cut into.
        group: the pp process group.
        device: where the stages run.
        loss_fn: ``loss_fn(output, target)`` of one microbatch, a mean over its samples.
        stage_type: makes each stage, as the stage class would (the simulator's answers torch's warm-up vote).
        stage_shapes: stage index -> ``PipelineStage`` keyword arguments giving its shapes statically
            (``input_args``, ``output_args``, ...); None: torch infers them at the first step, over p2p.
    """

    def __init__(
        self,
        split: PipelineSplit,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        stage_type: Callable[..., _Stage] | None = None,
        stage_shapes: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        self.stage_type, self.stage_shapes = stage_type or _Stage, stage_shapes
        self.split, self.spec, self.microbatches = split, schedule_spec(schedule), microbatches
        self.group, self.device, self.loss_fn = group, device, loss_fn
        self._schedules: dict[tuple, Any] = {}
        self._stages: dict[tuple, list[_Stage]] = {}
        self._unscaled: dict[int, Tensor] = {}  # id(scaled loss) -> the microbatch's loss
        self._loss_scale = 1.0
        # called with (a stage's index, False) just before its last microbatch's weight-gradient backward in
        # train_step and with (index, True) after it (overlap_grad_reduce arms that stage's gradient buckets there)
        self.on_last_backward: Callable[[int, bool], None] | None = None

    @property
    def holds_last_stage(self) -> bool:
        return self.split.num_stages - 1 in self.split.stages

    def _last_backward(self, stage_index: int, done: bool) -> None:
        if self.on_last_backward is not None:
            self.on_last_backward(stage_index, done)

    def _microbatch_loss(self, output: Any, target: Any) -> Tensor:
        recorder = active_recorder()
        if recorder is None:
            loss = self.loss_fn(output, target)
        else:  # the loss is the last stage's forward work: timed as "L", counted busy
            with recorder.action("L", self.split.num_stages - 1, len(self._unscaled)):
                loss = self.loss_fn(output, target)
        # the schedule backpropagates each microbatch's loss: scaled, their gradients add up to the mean's
        scaled = loss * self._loss_scale
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def _schedule(self, mode: str, args: tuple, kwargs: dict, target: Any) -> Any:
        key = (mode, _signature(args, kwargs, target))
        if key not in self._schedules:
            shapes = self.stage_shapes or (lambda index: {})
            stages = [
                self.stage_type(module, index, self.split.num_stages, self.device, group=self.group, **shapes(index))
                for index, module in sorted(self.split.stages.items())
            ]
            loss_fn = None if mode == "forward" else self._microbatch_loss
            # scale_grads=False: the loss is scaled instead, so gradients accumulated before survive
            kw: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
            for stage in stages:
                stage.submod.output_asks_grad = self.spec.split_backward
                stage.on_last_backward = self._last_backward
                stage.early_receives = self.microbatches if early_receives(self.spec.name, self.group) else 0
            sched = self.spec.build(stages, self.microbatches, **kw)
            self._schedules[key] = sched
            self._stages[key] = stages
        return self._schedules[key]

    def _check_batch(self, args: tuple) -> None:
        batch = next((a.shape[0] for a in args if isinstance(a, Tensor)), None)
        if batch is not None and batch % self.microbatches:
            raise ValueError(
                f"A batch of {batch} samples per data-parallel rank does not split into microbatches="
                f"{self.microbatches}: make the per-rank batch (global batch / (dp x accumulate_grad_batches)) "
                f"a multiple of {self.microbatches}, or set microbatches to a divisor of {batch}."
            )

    def _mean_loss(self, losses: list[Tensor]) -> Tensor:
        """The batch loss (mean of the microbatch means) on every pp rank."""
        if self.holds_last_stage:
            # the schedule's own list: shape inference may have called the loss once more
            value = torch.stack([self._unscaled[id(x)].float() for x in losses]).mean()
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        self._unscaled.clear()
        dist.all_reduce(value, group=self.group)  # only the last stage adds a non-zero
        return value

    def train_step(self, args: tuple, kwargs: dict, target: Any, loss_scale: float = 1.0) -> Tensor:
        """Forward and backward of one batch; gradients accumulate into the stage parameters."""
        self._check_batch(args)
        self._loss_scale = loss_scale / self.microbatches
        losses: list[Tensor] = []
        schedule = self._schedule("train", args, kwargs, target)
        with aux_loss_scale(self._loss_scale):  # MoE auxiliary losses: the factor each microbatch's loss carries
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        for stage in self._stages[("train", _signature(args, kwargs, target))]:
            assert not stage.__dict__.get("_early"), f"receives posted early were left unused: {stage._early}"
        return self._mean_loss(losses)

    def eval_loss(self, args: tuple, kwargs: dict, target: Any) -> Tensor:
        """The loss of a whole batch (no microbatches: nothing is kept for a backward), on every pp rank."""
        output = self._forward_walk(args, kwargs)
        if self.holds_last_stage:
            value = self.loss_fn(output, target).detach().float()
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.all_reduce(value, group=self.group)  # only the last stage adds a non-zero
        return value

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """The model's output for a whole batch, on every pp rank (a tensor-parallel output made whole)."""
        output = self._forward_walk(args, kwargs)
        if isinstance(output, DTensor):
            output = output.full_tensor()
        box = [output.cpu() if isinstance(output, Tensor) else output]
        last = self.split.stage_ranks[-1]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, last), group=self.group)
        result = box[0]
        return result.to(self.device) if isinstance(result, Tensor) else result

    def _forward_walk(self, args: tuple, kwargs: dict) -> Any:
        """Run the stages in order for the whole batch, passing activations between ranks.

        Forward-only runs do not go through torch's schedules: zero-bubble schedules run backward actions
        even in ``eval()``, and one batch at once gives exactly the single-process numbers.
        """
        me = dist.get_rank(self.group)
        ranks = self.split.stage_ranks
        x: Any = None
        for index, rank in enumerate(ranks):
            if rank != me:
                continue
            stage = self.split.stages[index]
            if index == 0:
                with _inputs_of_stage(kwargs):
                    x = stage(*args)
            else:
                if ranks[index - 1] != me:
                    x = _recv_activation(dist.get_global_rank(self.group, ranks[index - 1]), self.group, self.device)
                with _inputs_of_stage(kwargs):
                    x = stage(x)
            if index + 1 < len(ranks) and ranks[index + 1] != me:
                _send_activation(x, dist.get_global_rank(self.group, ranks[index + 1]), self.group, index)
        return x if self.holds_last_stage else None


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype, ndim, up to 8 sizes


def _send_activation(x: Any, dst: int, group: dist.ProcessGroup, stage: int) -> None:
    if isinstance(x, DTensor):
        x = x.to_local()
    if not isinstance(x, Tensor) or x.dim() > _HEADER - 2 or x.dtype not in _DTYPES:
        raise TypeError(
            f"Pipeline stage {stage} returned {type(x).__name__}: between stages a layer must return one tensor "
            "(of at most 8 dimensions); pack several values into one tensor or move the cut."
        )
    header = torch.zeros(_HEADER, dtype=torch.int64, device=x.device)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv_activation(src: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x
