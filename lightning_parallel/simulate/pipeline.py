"""Pipeline parallelism simulated: this rank's stages under the configured schedule, torch's own
(``parallel/pipeline/runner.py``'s :class:`~lightning_parallel.parallel.pipeline.runner.Pipeline`, the runner both
front doors drive), their shapes given statically.

On a real cluster torch learns each stage's shapes at the first step: the stages vote over p2p whether every one was
given its shapes, and if not, each runs its forward on what the previous stage sends it (``send_object_list``).
torch's ``fake`` process group carries every send and receive (the recorder sees each, with its shape, dtype and
peer) but delivers nothing, so here every stage is given its shapes: the first stage's inputs are its microbatch,
every other stage's are what crosses the first boundary (:func:`boundary_of`, the first stage's outputs on one
microbatch, run once on fake tensors on a rank that holds it), and each stage's outputs come from running it on
those inputs. The vote's messages are still issued, its outcome read as "every stage static"
(:class:`~lightning_parallel._compat.StaticVoteStage`). A middle stage whose outputs differ from its inputs (a model
whose stages exchange different tensors at different cuts) is refused: the boundaries past the first are taken to
carry what the first does, and this checks it on every middle stage simulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import StaticVoteStage
from lightning_parallel.parallel.expert.moe import moe_layers
from lightning_parallel.parallel.pipeline.runner import Pipeline, _Stage
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer, PipelineSplit
from lightning_parallel.parallel.pipeline.tied import TiedGradients
from lightning_parallel.parallel.tensor.loss import full_loss

Meta = tuple[tuple[int, ...], str]  # what crosses between two stages: one tensor's shape and dtype


@dataclass(frozen=True)
class FirstStage:
    """What a rank of a later stage learns from one that holds the first: what crosses the first boundary, and
    the first stage's entries of the weights tied across stages (``TiedGradients.local_entries``)."""

    boundary: tuple[Meta, ...]
    tied: list[Any] | None = None


def settle_tied(tied: TiedGradients, root: nn.Module, split: PipelineSplit, first: FirstStage | None) -> None:
    """``TiedGradients``' agreement on each tied group's shape and holders, which a real run makes over p2p
    (``all_gather_object``: values a fake process group cannot carry), from what this rank holds: a pp rank
    holds a copy if one of its stages does (the others' layers are ``ElsewhereLayer``), its shape is this rank's
    copy's, else the first stage's (``first``)."""
    elsewhere = {m.path: m.stage for m in root.modules() if isinstance(m, ElsewhereLayer)}
    pp, me = max(split.stage_ranks) + 1, split.stage_ranks[min(split.stages)]
    mine, theirs = tied.local_entries(), first.tied if first is not None else None
    everyone: list[list[Any]] = [[None] * len(mine) for _ in range(pp)]
    for g, names in enumerate(tied.tie_groups):
        entry = mine[g] if mine[g] is not None else (theirs[g] if theirs else None)
        if entry is None:
            raise ValueError(
                f"simulate: the weights tied across pipeline stages {names} have no copy on the first stage or this "
                "rank; the simulator learns their shape from one of them: simulate a rank that holds one."
            )
        for name in names:
            stage = next((s for path, s in elsewhere.items() if name.startswith(path + ".")), None)
            everyone[me if stage is None else split.stage_ranks[stage]][g] = entry
    tied.settle(everyone)


class SimulatedStage(_Stage, StaticVoteStage):
    """The runner's stage, given its shapes, answering torch's warm-up vote; ``forward_start`` (given the stage's
    module) and ``forward_done`` are called around each microbatch's forward (torch's ``MemTracker`` takes a second
    call of a root module for a new step unless its statistics are dropped first; the activations in flight are
    sampled after); ``tags`` (:class:`~lightning_parallel.simulate.scaling.MicrobatchTags`, when the step is
    extended from a shorter one) told each microbatch's forward, backward and sends and receives."""

    forward_start: Callable[[nn.Module], None] | None = None
    forward_done: Callable[[], None] | None = None
    tags: Any = None

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.forward_start is not None:
            self.forward_start(self.submod)
        with _tagged(self.tags, fwd_chunk_id):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.forward_done is not None:
            self.forward_done()
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with _tagged(self.tags, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> Any:
        return _p2p(self.tags, super().get_fwd_recv_ops(fwd_chunk_id), fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> Any:
        return _p2p(self.tags, super().get_fwd_send_ops(fwd_chunk_id), fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> Any:
        return _p2p(self.tags, super().get_bwd_recv_ops(bwd_chunk_id), bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> Any:
        return _p2p(self.tags, super().get_bwd_send_ops(bwd_chunk_id), bwd_chunk_id)


@contextlib.contextmanager
def _tagged(tags: Any, microbatch: int) -> Any:
    if tags is None:
        yield
        return
    tags.enter(microbatch)
    try:
        yield
    finally:
        tags.leave()


def _p2p(tags: Any, ops: Any, microbatch: int) -> Any:
    return ops if tags is None else tags.p2p(ops, microbatch)


def _metas(tensors: tuple[Any, ...]) -> tuple[Meta, ...]:
    for t in tensors:
        if isinstance(t, DTensor) or not isinstance(t, Tensor):
            raise ValueError(
                f"simulate: a pipeline stage passes {type(t).__name__} to the next one; the simulator gives stages "
                "their shapes for plain tensors between stages only (a DTensor output leaves the last stage alone)."
            )
    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors)


def _run_stage(stage: nn.Module, inputs: tuple[Tensor, ...], context: Any) -> tuple[Tensor, ...]:
    """The stage's outputs on ``inputs`` (fake), as gradient-asking placeholders: a no_grad forward, its ZeRO-3
    units resharded and its MoE layers' token counts dropped after (what torch's shape inference cleans up)."""
    with torch.no_grad(), context():
        out = stage(*inputs)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    for layer in moe_layers(stage).values():
        layer.forget_last()
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.detach().requires_grad_(o.is_floating_point()) for o in outs)


def _placeholders(boundary: tuple[Meta, ...], device: torch.device) -> tuple[Tensor, ...]:
    made = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in boundary]
    return tuple(t.requires_grad_(t.is_floating_point()) for t in made)


def static_shapes(
    split: PipelineSplit,
    microbatch: tuple[Tensor, ...],
    boundary: tuple[Meta, ...] | None,
    device: torch.device,
    context: Callable[[], Any] = contextlib.nullcontext,
) -> tuple[dict[int, dict[str, Any]], tuple[Meta, ...] | None]:
    """Each held stage's ``PipelineStage`` shape arguments, and what crosses the first boundary when this rank holds
    the first stage (else ``boundary`` back). Run under the fake mode, outside any recorder: ``context`` is the
    step's forward context (autocast, the vocabulary-parallel loss under tp)."""
    shapes: dict[int, dict[str, Any]] = {}
    for index, stage in sorted(split.stages.items()):
        if index == 0:
            inputs = microbatch
        elif boundary is None:
            raise RuntimeError(f"simulate: stage {index} needs what crosses the first boundary (boundary_of)")
        else:
            inputs = _placeholders(boundary, device)
        outputs = _run_stage(stage, inputs, context)
        last = index == split.num_stages - 1
        if index == 0:
            boundary = _metas(outputs)
        elif not last and _metas(outputs) != boundary:
            raise ValueError(
                f"simulate: pipeline stage {index} takes {boundary} and returns {_metas(outputs)}; the simulator "
                "gives every stage past the first the first stage's outputs as inputs, so stages must pass on what "
                "they take (a transformer's hidden states): simulate this model without pp."
            )
        kw: dict[str, Any] = {"input_args": inputs, "output_args": outputs}
        if any(isinstance(t, DTensor) for t in (*inputs, *outputs)):  # torch wants DTensors' gradients spelled out
            kw["output_grads"] = tuple(o.detach() for o in outputs)
            kw["input_grads"] = tuple(i.detach() if i.is_floating_point() else None for i in inputs)
        shapes[index] = kw
    return shapes, boundary


class SimulatedPipeline(Pipeline):
    """The runner's :class:`Pipeline` with :class:`SimulatedStage` stages; ``forward_start`` (given a stage's module)
    and ``forward_done`` (and ``tags``) are handed to each stage it builds (at the first step)."""

    forward_start: Callable[[nn.Module], None] | None = None
    forward_done: Callable[[], None] | None = None
    tags: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, stage_type=self._stage, **kwargs)

    def _stage(self, *args: Any, **kwargs: Any) -> SimulatedStage:
        made = SimulatedStage(*args, **kwargs)
        made.forward_start, made.forward_done, made.tags = self.forward_start, self.forward_done, self.tags
        return made

    def _microbatch_loss(self, output: Any, target: Any) -> Tensor:
        with _tagged(self.tags, len(self._unscaled)):  # the runner's count of losses so far: this microbatch
            return super()._microbatch_loss(output, target)


def simulated_pipeline(
    split: PipelineSplit,
    schedule: str,
    microbatches: int,
    group: Any,
    device: torch.device,
    loss_fn: Callable[[Any, Any], Tensor],
    shapes: dict[int, dict[str, Any]],
    tp: bool,
) -> SimulatedPipeline:
    """This rank's stages as Fabric's ``pipeline_step`` builds and drives them (under tp the loss made whole inside
    the schedule's one ``loss_parallel``), given static shapes."""
    loss = full_loss(loss_fn) if tp else loss_fn
    return SimulatedPipeline(split, schedule, microbatches, group, device, loss, stage_shapes=shapes.__getitem__)
