"""ZeRO stages 1 and 2 on one flat buffer per optimizer parameter group. Pure torch, no Lightning.

Hand-written because torch has no ZeRO-2, and its ``ZeroRedundancyOptimizer`` (ZeRO-1) assigns whole
parameters to ranks, so per-rank optimizer state is uneven. Here every group's parameters are packed
into one flat buffer (padded to a multiple of the data-parallel size) and each rank owns one contiguous
slice of it, as DeepSpeed does:

- the model's parameters become views into the flat buffer, replicated on every rank (4P bytes, fp32);
- stage 1 keeps full gradients in a flat buffer too (4P) and all-reduces them;
- stage 2 reduce-scatters gradients, keeps only its slice (4P/N) and frees the full ones;
- the user's optimizer is kept, with each group re-pointed at the rank's slice, so its state is 8P/N
  for Adam, LR schedulers keep working on the same object, and after each step the slices are
  all-gathered back into the replicated parameters.

Gradients are reduced once per optimizer step, after accumulation (the caller invokes
:meth:`FlatZero.reduce_gradients` after backward and before clipping; ``step`` does it if nobody did). The flat
groups of every optimizer group share their collectives (:func:`~.flat_group.comm_sets`): stage 1's gradient
buffers are views of one storage, all-reduced at once; stage 2 reduce-scatters one rank-major copy of them all, and
the parameters are all-gathered the same way, so a step issues one collective of each kind, not one per group.
"""

from __future__ import annotations

from functools import partial
from itertools import repeat
from operator import attrgetter, is_, is_not

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel._compat import all_gather_single, set_local_tensor
from lightning_parallel.parallel.data.flat_group import (
    SCALAR_STATE_KEYS,
    FlatGroup,
    all_gather_set,
    average,
    comm_sets,
    grad_storage,
    pack,
    rank_major,
)
from lightning_parallel.parallel.data.flat_overlap import FlatBuckets
from lightning_parallel.parallel.data.offload import HostSlice
from lightning_parallel.parallel.data.overlap import DEFAULT_BUCKET_MB, Prepare
from lightning_parallel.parallel.data.powersgd import PowerSGD
from lightning_parallel.parallel.dtensor import like, local, placed_like
from lightning_parallel.parallel.expert.apply import is_expert_param
from lightning_parallel.parallel.optim.muon_exchange import FlatMatrices

__all__ = ["SCALAR_STATE_KEYS", "FlatGroup", "FlatZero"]


class FlatZero:
    """Shards an existing optimizer's state (stage 1) and gradients (stage 2) over a process group.

    Args:
        optimizer: a fresh optimizer over the model's parameters; it is modified in place.
        group: the data-parallel process group to shard over.
        stage: 1 or 2.
        offload: keep this rank's slice of parameters, gradients and optimizer state on the host and
            step there (stage 2 only, as ZeRO-Offload; pinned, asynchronous copies with an accelerator:
            offload.py).
        replicate_group: HSDP: the ranks holding the same slice in the other replicas; each reduced slice is
            all-reduced over them, and gradients are divided by every data-parallel rank (hybrid_shard.py).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        group: dist.ProcessGroup,
        stage: int,
        offload: bool = False,
        expert_group: dist.ProcessGroup | None = None,
        wire_dtype: torch.dtype | None = None,
        overlap_bucket_mb: float | None = None,
        powersgd: PowerSGD | None = None,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        assert stage in (1, 2) and not (offload and stage == 1)
        self.optimizer = optimizer
        self.group = group
        self.expert_group = expert_group if expert_group is not None else group
        self.stage = stage
        self.offload = offload
        self.wire_dtype = wire_dtype  # gradient compression: the dtype of the reduction (None: the gradients' own)
        self.powersgd = powersgd  # grad_compression="powersgd": reduces each flat group's views (powersgd.py)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.replicate_group = replicate_group
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.divisor = self.world * replicas  # the replica's sum divided by every data-parallel rank
        # index of every parameter the optimizer held, in torch's state_dict numbering
        self.original_params: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        # per optimizer group: its flat groups (the data-parallel one, then the experts' one when it has experts)
        self.groups: list[list[FlatGroup]] = [self._shard_group(g) for g in optimizer.param_groups]
        # the flat groups each collective serves (under overlap_grad_reduce each group has its own buckets); stage
        # 1's gradients: one storage per set, each member's flat_grad a view of it, so one all-reduce needs no copy
        alone = overlap_bucket_mb is not None or powersgd is not None
        self.reduce_sets = comm_sets(self.flat_groups, None if stage == 1 else DEFAULT_BUCKET_MB)
        self.gather_sets = comm_sets(self.flat_groups, DEFAULT_BUCKET_MB)
        if alone:
            self.reduce_sets = self.gather_sets = [[fg] for fg in self.flat_groups]
        self.grad_storages = [grad_storage(fgs) for fgs in self.reduce_sets] if stage == 1 else []
        # overlap_grad_reduce: each flat group reduced bucket by bucket during backward and its parameters
        # gathered bucket by bucket after the step (flat_overlap.py)
        self._overlap: dict[int, FlatBuckets] = {}
        if overlap_bucket_mb is not None:
            for fg in self.flat_groups:
                deliver = partial(self._deliver, fg)
                self._overlap[id(fg)] = FlatBuckets(fg, stage, wire_dtype, overlap_bucket_mb, deliver)
        self.forward_waits = False  # forward pre-hooks wait for the gathers (else _after_step waits at once)
        self._reduced = False
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(lambda *_: self._after_step())

    def _shard_group(self, param_group: dict) -> list[FlatGroup]:
        params = [p for p in param_group["params"] if p.requires_grad]
        kinds = [[p for p in params if not is_expert_param(p)], [p for p in params if is_expert_param(p)]]
        made = [self._flat_group(members, expert) for expert, members in enumerate(kinds) if members]
        param_group["params"] = [fg.shard for fg in made]
        if param_group.get("use_muon") and hasattr(
            self.optimizer, "flat_layouts"
        ):  # MuonAdamW: each matrix gathered whole from the slices (muon_exchange.py)
            for fg in made:
                self.optimizer.flat_layouts[id(fg.shard)] = muon_layout(fg, bool(param_group.get("stacked_experts")))
        return made

    def _flat_group(self, params: list[nn.Parameter], expert: int) -> FlatGroup:
        group = self.expert_group if expert else self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        offsets, shard_numel, flat_param = pack(params, world)
        shard = flat_param[rank * shard_numel : (rank + 1) * shard_numel]
        host = HostSlice(shard) if self.offload else None
        shard = host.param if host is not None else shard
        fg = FlatGroup(
            params, offsets, shard_numel, flat_param, None, shard, group, rank, self.divisor, bool(expert), host
        )
        for p, view in fg.views(flat_param):
            if isinstance(p, DTensor):
                set_local_tensor(p, view)  # an alias: assigning .data would copy
            else:
                p.data = view
        fg.plain = not any(isinstance(p, DTensor) for p in params)
        return fg

    @property
    def flat_groups(self) -> list[FlatGroup]:
        return [fg for fgs in self.groups for fg in fgs]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
        # The closure (forward and backward) runs inside step(), so reduce after it, not before.
        closure = kwargs.get("closure")
        if closure is None:
            self.reduce_gradients()
            return None

        def closure_then_reduce():
            result = closure()
            self.reduce_gradients()
            return result

        return args, {**kwargs, "closure": closure_then_reduce}

    def arm(self, only: list[nn.Parameter] | None = None, prepare: Prepare | None = None) -> None:
        """overlap_grad_reduce: the next backward is the step's last (see overlap.py)."""
        for buckets in self._overlap.values():
            buckets.arm(only, prepare)

    def arm_more(self, params: list[nn.Parameter], ready: bool = False) -> None:
        for buckets in self._overlap.values():
            buckets.arm_more(params, ready)

    def settle(self) -> None:
        """Wait for the parameter gathers of the last step still in flight (overlap_grad_reduce)."""
        for buckets in self._overlap.values():
            buckets.settle()

    def reduce_gradients(self) -> None:
        """Average gradients over the group; each rank keeps (stage 2) or reads (stage 1) its slice."""
        if self._reduced:
            return
        self.settle()  # the step writes this rank's range: no gather may still be reading it
        for index, fgs in enumerate(self.reduce_sets):
            if len(fgs) > 1:
                self._reduce_together(fgs, self.grad_storages[index] if self.grad_storages else None)
                continue
            overlapped = self._overlap.get(id(fgs[0]))
            if overlapped is not None and overlapped.finish():
                continue  # reduced bucket by bucket during backward
            self._deliver(fgs[0], self._reduce_flat(fgs[0], self._collect(fgs[0])))
        for fg in self.flat_groups:
            if fg.host is not None:
                fg.host.wait()  # offload: the host reads the gradients from here on (clipping, the step)
        self._reduced = True

    def _collect(self, fg: FlatGroup) -> Tensor:
        """The flat group's local gradients in one flat buffer (stage 1: ``flat_grad``, which autograd filled)."""
        grads = list(map(_grad, fg.params))  # C calls only: no Python work per parameter
        if fg.grad_views is not None and all(map(is_, grads, fg.grad_views)):
            return fg.flat_grad  # every gradient accumulated into its view: nothing to copy
        if fg.plain and fg.flat_grad is None and all(map(is_not, grads, repeat(None))):
            # stage 2: one copy of them all, padded
            padding = fg.flat_param.new_zeros(fg.flat_param.numel() - fg.offsets[-1] - grads[-1].numel())
            for p in fg.params:
                p.grad = None  # the full gradient is freed once reduced
            return _flatten_dense_tensors([*grads, padding])
        flat = fg.flat_grad if fg.flat_grad is not None else torch.zeros_like(fg.flat_param)
        # stage 1, plain: the views .grad keeps, so that the next step finds them in place (the check above)
        views = fg.grad_views if fg.grad_views is not None else [v for _, v in fg.views(flat)]
        for p, view in zip(fg.params, views):
            if p.grad is not None and local(p.grad).data_ptr() != view.data_ptr():
                view.add_(local(placed_like(p, p.grad)))  # a gradient autograd allocated itself
            if fg.flat_grad is not None:
                p.grad = like(p, view)
            else:
                p.grad = None  # stage 2: the full gradient is freed once reduced
        return flat

    def _reduce_flat(self, fg: FlatGroup, flat: Tensor) -> Tensor:
        """``flat`` averaged over the group; returns this rank's slice of the average (on the device)."""
        start, end = fg.local_range()
        if self.powersgd is not None:  # every view averaged in place (matrices by their factors): take the slice
            self.powersgd.reduce(list(fg.views(flat)), fg.group, fg.divisor)
            return flat[start:end] if fg.flat_grad is not None else flat[start:end].clone()
        averaged = average(flat, fg, self.stage, self.wire_dtype)
        return averaged[start:end] if self.stage == 1 else averaged

    def _reduce_together(self, fgs: list[FlatGroup], storage: Tensor | None) -> None:
        """The gradients of several flat groups averaged by one collective: stage 1 all-reduces ``storage``, which
        their ``flat_grad`` buffers are views of; stage 2 reduce-scatters one rank-major copy of them all."""
        flats = [self._collect(fg) for fg in fgs]
        if storage is not None:
            average(storage, fgs[0], self.stage, self.wire_dtype)
            grads = [fg.flat_grad[slice(*fg.local_range())] for fg in fgs]  # type: ignore[index]
        else:
            whole = rank_major(flats, fgs[0].world)
            del flats  # each group's copy is freed before the collective's output is allocated
            grads = list(average(whole, fgs[0], self.stage, self.wire_dtype).split([fg.shard_numel for fg in fgs]))
        for fg, grad in zip(fgs, grads):
            self._deliver(fg, grad)

    def _deliver(self, fg: FlatGroup, grad: Tensor) -> None:
        """This rank's reduced gradient slice (on the device) becomes what the optimizer steps with: under offload
        copied into the host buffer (async with an accelerator: waited for at the end of ``reduce_gradients``).
        Every collective on it comes before: HSDP's replica all-reduce runs here, on the device (on CUDA the replicate
        group is NCCL only and has no backend for host tensors)."""
        if self.replicate_group is not None:
            wire = self.wire_dtype if self.wire_dtype not in (None, grad.dtype) else None
            sent = grad.to(wire) if wire is not None else grad
            dist.all_reduce(sent, group=self.replicate_group)  # the only collective that crosses replicas
            if wire is not None:
                grad.copy_(sent)
        fg.shard.grad = fg.host.grad_from(grad) if fg.host is not None else grad

    def shard_grad_segments(self) -> list[tuple[Tensor, nn.Parameter, FlatGroup]]:
        """This rank's reduced gradient slice cut at parameter boundaries: (view, parameter, its flat group).

        Gradient-norm code needs to know which parameter each element belongs to, because a tensor-parallel
        shard is summed over tp ranks while a replicated parameter must be counted once.
        """
        self.reduce_gradients()
        segments = []
        for fg in self.flat_groups:
            if fg.shard.grad is None:
                continue
            start, end = fg.local_range()
            for p, off in zip(fg.params, fg.offsets):
                lo, hi = max(start, off), min(end, off + local(p).numel())
                if lo < hi:
                    segments.append((fg.shard.grad[lo - start : hi - start], p, fg))
        return segments

    def _after_step(self) -> None:
        for fg in self.flat_groups:
            if fg.host is not None:  # queued before the gathers that read it, in stream order
                fg.host.param_to(fg.flat_param[slice(*fg.local_range())])
        for fgs in self.gather_sets:
            if len(fgs) > 1:
                all_gather_set(fgs)
                continue
            fg = fgs[0]
            overlapped = self._overlap.get(id(fg))
            if overlapped is not None:
                overlapped.gather()  # async, bucket by bucket: each waited for before the forward uses it
                if not self.forward_waits:
                    overlapped.settle()  # no forward hooks yet: nothing else would wait
            else:  # the input is copied because it aliases the output buffer
                all_gather_single(fg.flat_param, fg.flat_param[slice(*fg.local_range())].clone(), group=fg.group)
        for storage in self.grad_storages:
            storage.zero_()  # stage 1: every flat group's gradients at once
        for fg in self.flat_groups:
            for p in [] if fg.plain or fg.flat_grad is None else fg.params:
                if isinstance(p, DTensor):
                    p.grad = None  # autograd allocates the next one (see _shard_group)
        self._reduced = False

    def discard_unstepped(self) -> None:
        """Drop reduced gradients that no ``step()`` consumed (an fp16 overflow skipped it, or there was no
        backward): the next window then accumulates from zero, as after a step. A no-op after ``step()``."""
        if not self._reduced:
            return
        for fg in self.flat_groups:
            fg.shard.grad = None
            if fg.flat_grad is not None:
                fg.flat_grad.zero_()
                for p in fg.params:
                    if isinstance(p, DTensor):
                        p.grad = None
        self._reduced = False

    def reload_offloaded(self) -> None:
        """After the flat buffers were loaded in place: refresh the host copy of this rank's slice (offload),
        which is what the optimizer steps."""
        for fg in self.flat_groups:
            if fg.host is not None:
                start, end = fg.local_range()
                fg.host.param_from(fg.flat_param[start:end])


_grad = attrgetter("grad")


def muon_layout(fg: FlatGroup, stacked: bool = False) -> FlatMatrices:
    """The matrices of a MuonAdamW group's flat buffer, for its owners to gather whole (each a plain tensor here).
    ``stacked``: stacks (E, in, out) of expert matrices, each expert its own matrix (under ep, this rank's experts)."""
    split = [p for p in fg.params if isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements)]
    if stacked:  # experts split over ep on their first dimension only: the local experts are whole
        split = [p for p in split if any(getattr(x, "dim", None) != 0 for x in p.placements if not x.is_replicate())]
    if split or fg.host is not None:
        why = "offload steps a host copy of the slice" if fg.host is not None else "tp splits its matrices too"
        raise TypeError(
            f"MuonAdamW under ZeRO-1/2 with {why}: use zero_stage=3, whose matrices each stay one DTensor, or AdamW."
        )
    if not stacked:
        return FlatMatrices(fg.group, fg.shard_numel, list(fg.offsets), [p.shape for p in fg.params])
    offsets, shapes, lr_shapes = [], [], []
    for p, offset in zip(fg.params, fg.offsets):
        experts, rows, cols = local(p).shape
        for e in range(experts):
            offsets.append(offset + e * rows * cols)
            shapes.append(torch.Size((rows, cols)))
            lr_shapes.append(torch.Size((cols, rows)))  # (in, out) stored: the lr by (out, in), as a Linear's
    return FlatMatrices(fg.group, fg.shard_numel, offsets, shapes, lr_shapes)
