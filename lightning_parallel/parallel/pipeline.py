"""Pipeline parallelism on the ``pp`` axis with ``torch.distributed.pipelining``. Pure torch.

What torch leaves to us, and this module adds:

- splitting a model given as an ordered list of layers, in place: this rank keeps its stages' layers
  under their original names (so checkpoints do not depend on the layout) and every other layer is
  swapped for a parameter-free placeholder;
- weights tied across stages (GPT's embedding and head): each stage keeps its own copy, their gradients
  are summed over the pp axis before the update, so the copies stay equal;
- one schedule per input shape and mode (train, eval, forward-only): torch infers stage shapes once per
  schedule;
- the pipeline loss (it exists on the last stage only) reduced to every pp rank, so logs and checkpoint
  callbacks see the same value everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.partition import stage_to_rank
from lightning_parallel.parallel.pipeline_timeline import active_recorder
from lightning_parallel.parallel.tensor import tied_parameters

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def stages_per_rank(schedule: str, virtual_stages: int | None = None) -> int:
    """Stages each pp rank runs: 1 for GPipe and 1F1B, ``virtual_stages`` (default 2) for interleaved
    1F1B, exactly 2 for zero-bubble (ZB-V)."""
    if schedule in ("gpipe", "1f1b"):
        return 1
    if schedule == "zero_bubble":
        return 2
    return 2 if virtual_stages is None else virtual_stages


def check_microbatches(schedule: str, microbatches: int, pp: int, setting: str) -> None:
    """What torch's schedules need of the microbatch count, checked before any process starts."""
    if schedule == "gpipe" or pp == 1:
        return
    if microbatches < pp:
        raise ValueError(
            f"{setting}: pp_schedule={schedule!r} needs at least one microbatch per stage, but microbatches="
            f"{microbatches} < pp={pp}: set microbatches to {pp} or more (2*pp keeps the bubble small)."
        )
    rounds = max(1, microbatches // pp)
    if schedule != "1f1b" and microbatches % rounds:
        raise ValueError(
            f"{setting}: pp_schedule={schedule!r} runs microbatches in rounds of pp={pp}, so microbatches="
            f"{microbatches} must be a multiple of {rounds}: set microbatches to a multiple of {pp}."
        )


def layer_paths(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The module path of every layer inside ``root``."""
    names = {id(m): name for name, m in root.named_modules()}
    paths = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module) or id(layer) not in names:
            raise TypeError(
                f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of {type(root).__name__}: "
                "return the module's own layers, in the order its forward runs them."
            )
        paths.append(names[id(layer)])
    if len(set(paths)) != len(paths):
        raise TypeError("pipeline_layers() lists a layer twice: list each layer once, in forward order.")
    return paths


class ElsewhereLayer(nn.Module):
    """Stands in for a layer that another pipeline stage holds; it has no parameters and cannot run."""

    def __init__(self, path: str, stage: int) -> None:
        super().__init__()
        self.path, self.stage = path, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.path} lives on pipeline stage {self.stage}, not on this rank: under pp > 1 run the model "
            "through the strategy (self(x) then self.loss(output, target) in a step), not layer by layer."
        )

    def extra_repr(self) -> str:
        return f"{self.path} on stage {self.stage}"


class StageModule(nn.Module):
    """A contiguous run of layers, called in order: what one pipeline stage computes."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            x = layer(x)
        if isinstance(x, Tensor) and x._is_view():
            x = x.clone()  # stages detach their outputs in place, which views do not allow
        return x


@dataclass
class PipelineSplit:
    """This rank's part of a model split into pipeline stages."""

    stages: dict[int, StageModule]  # stage index -> its layers, for the stages this rank runs
    num_stages: int
    stage_ranks: list[int]  # pp rank of every stage
    tie_groups: list[list[str]]  # parameter names that were one tied weight before the split
    canonical: dict[str, str] = field(default_factory=dict)  # every parameter name -> its first name
    order: list[str] = field(default_factory=list)  # canonical parameter names in the unsplit model's order


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def split_model(
    root: nn.Module, paths: Sequence[str], partition: Sequence[range], stage_ranks: Sequence[int], pp_rank: int
) -> PipelineSplit:
    """Keep only this rank's stages in ``root`` (in place) and return them as stage modules.

    Tied weights are untied into one parameter per kept site; ``tie_groups`` names them for
    :class:`TiedGradients`.
    """
    canonical: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        canonical[name] = first_name.setdefault(id(p), name)
    order = list(dict.fromkeys(canonical.values()))
    ties = [[f"{path}.{name}" if path else name for path, name in sites] for sites in tied_parameters(root)]

    stages: dict[int, StageModule] = {}
    for stage, layer_range in enumerate(partition):
        if stage_ranks[stage] == pp_rank:
            stages[stage] = StageModule([root.get_submodule(paths[i]) for i in layer_range])
        else:
            for i in layer_range:
                _set_module(root, paths[i], ElsewhereLayer(paths[i], stage))

    kept = dict(root.named_parameters(remove_duplicate=False))
    for names in ties:
        here = [n for n in names if n in kept]
        for name in here[1:]:  # each site its own parameter; TiedGradients keeps them equal
            module_path, _, attr = name.rpartition(".")
            module = root.get_submodule(module_path) if module_path else root
            original = getattr(module, attr)
            setattr(module, attr, nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))
    return PipelineSplit(stages, len(partition), list(stage_ranks), ties, canonical, order)


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class TiedGradients:
    """Sums the gradients of weights tied across pipeline stages over the pp axis (collective).

    Every pp rank takes part in every tied group, with zeros where it holds no copy, so all ranks issue
    the same all-reduces. The copy on the lowest pp rank is the one gradient-norm code counts.
    """

    def __init__(self, root: nn.Module, tie_groups: list[list[str]], group: dist.ProcessGroup) -> None:
        self.root, self.group = root, group
        self.tie_groups = tie_groups
        self._shapes: list[tuple[torch.Size, torch.dtype]] | None = None
        self._counted_elsewhere: set[int] = set()

    def _members(self, names: list[str]) -> list[nn.Parameter]:
        params = dict(self.root.named_parameters(remove_duplicate=False))
        found: dict[int, nn.Parameter] = {}
        for n in names:
            if n in params:
                found.setdefault(id(params[n]), params[n])
        return list(found.values())

    def _agree(self) -> None:
        """Learn each group's local shape and which pp ranks hold it (once, after all sharding)."""
        mine = []
        for names in self.tie_groups:
            members = self._members(names)
            mine.append((tuple(_local(members[0]).shape), _local(members[0]).dtype) if members else None)
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        rank = dist.get_rank(self.group)
        self._shapes = []
        for g, names in enumerate(self.tie_groups):
            holders = [r for r, entry in enumerate(everyone) if entry[g] is not None]
            shape, dtype = everyone[holders[0]][g]
            self._shapes.append((torch.Size(shape), dtype))
            members = self._members(names)
            # count the weight once in norms: on the lowest holding rank, its first copy
            skip = members if rank != holders[0] else members[1:]
            self._counted_elsewhere.update(id(p) for p in skip)

    def excluded_from_norm(self) -> set[int]:
        """Ids of this rank's tied copies whose gradient another copy already counts."""
        if self._shapes is None:
            self._agree()
        return self._counted_elsewhere

    def reduce(self) -> None:
        if self._shapes is None:
            self._agree()
        assert self._shapes is not None
        for names, (shape, dtype) in zip(self.tie_groups, self._shapes):
            members = self._members(names)
            device = _local(members[0]).device if members else torch.device("cpu")
            total = torch.zeros(shape, dtype=dtype, device=device)
            for p in members:
                if p.grad is not None:
                    grad = p.grad
                    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                        grad = grad.redistribute(placements=p.placements)
                    total += _local(grad)
            dist.all_reduce(total, group=self.group)
            for p in members:
                grad = p.grad
                if grad is None or (isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements)):
                    p.grad = _grad_like(p, total.clone())
                else:
                    _local(grad).copy_(total)  # in place: the gradient may be a view into a flat buffer


def _grad_like(p: nn.Parameter, local: Tensor) -> Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    return local


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves running statistics alone.

    To learn shapes, torch runs each stage once in train mode on placeholder inputs (uninitialized memory
    on every stage but the first); BatchNorm would fold that run into its running statistics (NaN seen).
    The buffers are restored right after. While a ``pipeline_timeline.TimelineRecorder`` is active, every
    forward and backward of a microbatch is timed.
    """

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        self._buffers_before = [b.detach().clone() for b in submodule.buffers()]

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        with torch.no_grad():
            for buffer, before in zip(self.submod.buffers(), self._buffers_before):
                buffer.copy_(before)
        self._buffers_before = []

    # Timeline hook: each action is timed while a TimelineRecorder is active (one None check otherwise).
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        recorder = active_recorder()
        if recorder is None:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        with recorder.action("F", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kwargs: Any) -> Any:
        recorder = active_recorder()
        if recorder is None:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, **kwargs)
        with recorder.action("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        recorder = active_recorder()
        if recorder is None:
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        with recorder.action("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def _signature(args: tuple, kwargs: dict, target: Any) -> tuple:
    def sig(x: Any) -> Any:
        return (tuple(x.shape), x.dtype) if isinstance(x, Tensor) else type(x).__name__

    return tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in sorted(kwargs.items())), sig(target)


class Pipeline:
    """Runs this rank's stages under one schedule for whole batches: train steps, eval losses, outputs.

    Args:
        split: this rank's stages.
        schedule: one of :data:`SCHEDULES`.
        microbatches: microbatches each batch is cut into.
        group: the pp process group.
        device: where the stages run.
        loss_fn: ``loss_fn(output, target)`` of one microbatch, a mean over its samples.
    """

    def __init__(
        self,
        split: PipelineSplit,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: Callable[[Any, Any], Tensor],
    ) -> None:
        self.split, self.schedule_name, self.microbatches = split, schedule, microbatches
        self.group, self.device, self.loss_fn = group, device, loss_fn
        self._schedules: dict[tuple, Any] = {}
        self._unscaled: dict[int, Tensor] = {}  # id(scaled loss) -> the microbatch's loss
        self._loss_scale = 1.0

    @property
    def holds_last_stage(self) -> bool:
        return self.split.num_stages - 1 in self.split.stages

    def _microbatch_loss(self, output: Any, target: Any) -> Tensor:
        loss = self.loss_fn(output, target)
        # the schedule backpropagates each microbatch's loss: scaled, their gradients add up to the mean's
        scaled = loss * self._loss_scale
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def _schedule(self, mode: str, args: tuple, kwargs: dict, target: Any) -> Any:
        key = (mode, _signature(args, kwargs, target))
        if key not in self._schedules:
            stages = [
                _Stage(module, index, self.split.num_stages, self.device, group=self.group)
                for index, module in sorted(self.split.stages.items())
            ]
            loss_fn = None if mode == "forward" else self._microbatch_loss
            # scale_grads=False: the loss is scaled instead, so gradients accumulated before survive
            kw: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
            if self.schedule_name == "gpipe":
                sched = ScheduleGPipe(stages[0], self.microbatches, **kw)
            elif self.schedule_name == "1f1b":
                sched = Schedule1F1B(stages[0], self.microbatches, **kw)
            elif self.schedule_name == "interleaved_1f1b":
                sched = ScheduleInterleaved1F1B(stages, self.microbatches, **kw)
            else:
                sched = ScheduleZBVZeroBubble(stages, self.microbatches, **kw)
            self._schedules[key] = sched
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
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
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
                x = stage(*args, **kwargs)
            else:
                if ranks[index - 1] != me:
                    x = _recv_activation(dist.get_global_rank(self.group, ranks[index - 1]), self.group, self.device)
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


def stage_ranks_for(schedule: str, num_stages: int, pp: int) -> list[int]:
    return stage_to_rank(num_stages, pp, "v" if schedule == "zero_bubble" else "loop")
