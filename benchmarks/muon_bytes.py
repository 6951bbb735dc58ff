"""The worker's side of ``make bench``'s Muon section (benchmarks/muon.py): the bytes one optimizer step sends,
counted at torch's dispatcher, and the same bytes by the formula of parallel/optim/muon_exchange.py, computed from
the shapes and the optimizer's owner assignment (:func:`~lightning_parallel.parallel.optim.muon_owners.owners`).

Counted: every collective issued between ``on_before_optimizer_step`` and the end of the monitor's measured step
(the optimizer step alone: the gradients are reduced before it). The optimizer step's wall and CPU time (the
main thread's) are taken on the timed steps before it. An ``all_to_all_single`` counts exactly the
elements this rank sends to the other ranks (its input splits but its own); the other collectives as
parallel/measure/comm_volume.py counts them (an even all-gather: exactly what a rank sends).

Formula (:func:`exchange_formula`): the optimizer's cases (parallel/optim/muon_exchange.py), each from the
matrices' shapes and placements and the optimizer's ``owners`` (balanced by ``ns_cost``) and ``chunk_sizes``, never
from its counters. With ``b`` the Newton-Schulz dtype's element size and ``n[m][q]`` matrix ``m``'s elements on
rank ``q`` of a group, a rank ``r`` sends, for the matrices one group splits (ZeRO-3 and FSDP2 over dp, tp's rows or
columns, ZeRO-1/2's flat segments)::

    b * ( sum over m not owned by r of n[m][r]  +  sum over m owned by r of (|m| - n[m][r]) )

for whole matrices alike on every rank of a group of ``W`` (our ZeRO-0; Lightning's ``ddp`` sets no group and
sends nothing) ``b (W - 1) * sum over m owned by r of |m|``; under HSDP the owner replica's shard group exchanges
as above and each rank sends its pieces of that replica's matrices to the ``R - 1`` others; under dp x tp ZeRO-3
(parallel/optim/muon_mesh.py) the first sum over dp (the dp slices of this rank's tp piece, owners' dp index) plus
the same over tp for the matrices its dp index owns (the tp pieces, owners' tp index). Any other split on several
mesh dimensions is gathered whole (``full_tensor``) in the update's dtype.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.measure.comm_volume import CommCounter
from lightning_parallel.parallel.optim.muon import NS_DTYPES, MuonAdamW
from lightning_parallel.parallel.optim.muon_mesh import tp_shape, two_axes
from lightning_parallel.parallel.optim.muon_owners import chunk_sizes, ns_cost, owners, prod


class ExactCounter(CommCounter):
    """A :class:`CommCounter` that also notes what each ``all_to_all_single`` sends exactly: ``exact_sent`` (bytes,
    every op, all-to-alls exact) and ``all_to_all_sent`` (the all-to-alls alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.exact_sent = 0.0
        self.all_to_all_sent = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for event in self.events[before:]:
            if func.namespace == "c10d" and func._schema.name.endswith("alltoall_base_"):
                sent = _all_to_all_sent(args)
                self.all_to_all_sent += sent
                self.exact_sent += sent
            else:
                self.exact_sent += event.sent_bytes
        return out


def _all_to_all_sent(args: tuple) -> int:
    """``c10d::alltoall_base_(output, input, group, output_splits, input_splits, ...)``: the input's elements bound
    for the other ranks, in bytes (no splits: equal ones)."""
    source, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), list(args[4])
    world, rank = group.size(), group.rank()
    splits = splits or [source.shape[0] // world] * world
    row = source[0].numel() if source.dim() > 1 else 1
    return (sum(splits) - splits[rank]) * row * source.element_size()


def _owner_elements(numels: list[list[int]], owner: list[int], rank: int) -> int:
    """Elements ``rank`` sends in one gather to the owners and the scatter back (two ``all_to_all_single``):
    its piece of each matrix it does not own, and the others' pieces of each matrix it owns."""
    return sum(sum(n) - n[rank] if owner[m] == rank else n[rank] for m, n in enumerate(numels))


def _split_numels(shape: tuple[int, ...], dim: int, world: int) -> list[int]:
    """Each rank's elements of a matrix of ``shape`` split by ``Shard(dim)`` over ``world`` ranks."""
    rest = prod(shape) // shape[dim] if shape[dim] else 0
    return [n * rest for n in chunk_sizes(shape[dim], world)]


def _one_group(shapes: list[tuple[int, ...]], dims: list[int], group: Any) -> int:
    """Matrices split over one process group (ZeRO-3, FSDP2, tp): owners over its ranks by ``ns_cost``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numels = [_split_numels(s, d, world) for s, d in zip(shapes, dims)]
    return _owner_elements(numels, owners([ns_cost(s) for s in shapes], world), rank)


def _replicated(shapes: list[tuple[int, ...]], group: Any) -> int:
    """Whole matrices alike on every rank of ``group`` (ZeRO-0): each owner sends its results to the others."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = owners([ns_cost(s) for s in shapes], world)
    return (world - 1) * sum(prod(s) for m, s in enumerate(shapes) if owner[m] == rank)


def _hsdp(shapes: list[tuple[int, ...]], dims: list[int], mesh: Any, shard_dim: int) -> int:
    """HSDP: owners over replicas x shards; the owner replica's shard group exchanges its matrices, then each rank
    sends its pieces of them to the other replicas."""
    replicas, shards = mesh.size(1 - shard_dim), mesh.size(shard_dim)
    replica, shard = mesh.get_local_rank(1 - shard_dim), mesh.get_local_rank(shard_dim)
    pair = owners([ns_cost(s) for s in shapes], replicas * shards)
    mine = [m for m in range(len(shapes)) if pair[m] // shards == replica]
    numels = [_split_numels(shapes[m], dims[m], shards) for m in mine]
    inside = _owner_elements(numels, [pair[m] % shards for m in mine], shard)
    return inside + (replicas - 1) * sum(n[shard] for n in numels)


def _two_axes(shapes: list[tuple[int, ...]], dims: list[int], mesh: Any) -> int:
    """dp x tp ZeRO-3 (parallel/optim/muon_mesh.py): owners over dp x tp; over dp (the dp slices of this rank's tp
    piece), over tp within the owner's dp row (the tp pieces), and back."""
    dp, tp, i, j = mesh.size(0), mesh.size(1), mesh.get_local_rank(0), mesh.get_local_rank(1)
    pair = owners([ns_cost(s) for s in shapes], dp * tp)
    numels = []  # over dp: the dp slices of this rank's tp piece
    for s, d in zip(shapes, dims):
        piece = tp_shape(s, d, tp, j)
        numels.append([r * prod(piece[1:]) for r in chunk_sizes(piece[0], dp)])
    over_dp = _owner_elements(numels, [q // tp for q in pair], i)
    mine = [m for m in range(len(shapes)) if pair[m] // tp == i]
    tp_numels = [[prod(tp_shape(shapes[m], dims[m], tp, q)) for q in range(tp)] for m in mine]
    return over_dp + _owner_elements(tp_numels, [pair[m] % tp for m in mine], j)


def _flat(layout: Any) -> int:
    """ZeRO-1/2: each matrix's segments of the flat slices, to its owner and back."""
    world = dist.get_world_size(layout.group)
    numels = [[max(0, hi - lo) for lo, hi in layout.segments(m, world)] for m in range(len(layout.shapes))]
    costs = [ns_cost(tuple(s)) for s in layout.shapes]
    return _owner_elements(numels, owners(costs, world), dist.get_rank(layout.group))


def _placement(p: Any) -> tuple[str, Any, int, int]:
    """How the optimizer exchanges ``p`` (muon_exchange.orthogonalize_all's cases): (kind, group or mesh, mesh dim,
    tensor dim), kind "whole" (a group or None), "group", "hsdp", "two_axes" or "full"."""
    if not isinstance(p, DTensor):
        return "whole", None, 0, 0
    split = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate()]
    experts = p.ndim == 3 and all(getattr(pl, "dim", None) == 0 for _, pl in split)
    if not split or experts:
        mesh = p.device_mesh
        return "whole", mesh.get_group() if mesh.ndim == 1 and not experts else None, 0, 0
    if len(split) == 1 and type(split[0][1]) is Shard:
        mesh, (mesh_dim, placement) = p.device_mesh, split[0]
        if mesh.ndim == 2 and p.placements[1 - mesh_dim].is_replicate() and mesh.size(1 - mesh_dim) > 1:
            return "hsdp", mesh, mesh_dim, placement.dim
        return "group", mesh.get_group(mesh_dim), mesh_dim, placement.dim
    d = two_axes(p)
    return ("two_axes", p.device_mesh, 0, d) if d is not None else ("full", None, 0, 0)


def exchange_formula(optimizer: Any) -> int:
    """Bytes this rank sends in one Muon step, by the formula (0 for an optimizer that is not Muon's): the
    optimizer's cases (parallel/optim/muon_exchange.py) from the parameters' shapes and placements alone."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(opt, MuonAdamW):
        return 0
    total = 0
    for group in (g for g in opt.param_groups if g["use_muon"]):
        width = torch.finfo(NS_DTYPES.get(group["ns_dtype"], group["ns_dtype"])).bits // 8
        cases: dict[tuple, tuple[Any, list[tuple[int, ...]], list[int]]] = {}  # -> (group or mesh, shapes, dims)
        for p in group["params"]:
            if id(p) in opt.flat_layouts:
                total += width * _flat(opt.flat_layouts[id(p)])
                continue
            kind, where, axis, dim = _placement(p)
            if kind == "whole":
                where = opt.replica_group if not isinstance(p, DTensor) else where
                if where is None or dist.get_world_size(where) == 1:
                    continue  # orthogonalized where it is: nothing sent
            if kind == "full":  # gathered whole on every rank in the update's dtype (full_tensor)
                total += local(p).element_size() * (p.numel() - local(p).numel())
                continue
            key = (kind, id(where), 0) if kind in ("whole", "group") else (kind, _mesh_key(where), axis)
            entry = cases.setdefault(key, (where, [], []))
            entry[1].append(tuple(p.shape))
            entry[2].append(dim)
        for (kind, _, axis), (where, shapes, dims) in cases.items():
            if kind == "whole":
                total += width * _replicated(shapes, where)
            elif kind == "group":
                total += width * _one_group(shapes, dims, where)
            elif kind == "hsdp":
                total += width * _hsdp(shapes, dims, where, axis)
            else:
                total += width * _two_axes(shapes, dims, where)
    return total


def _mesh_key(mesh: Any) -> tuple:
    return tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names


class OptimizerStepBytes(pl.Callback):
    """Counts the collectives of one optimizer step (``measure_step``, the monitor's) with :class:`ExactCounter` and
    computes the formula: ``result`` after that step. List it before the TrainingMonitor: its counter is entered
    after the monitor's and must be left first."""

    def __init__(self, measure_step: int, warmup: int = 2) -> None:
        self.measure_step, self.warmup = measure_step, warmup
        self.counter: ExactCounter | None = None
        self.result: dict[str, Any] = {}
        self.times: list[tuple[float, float]] = []  # each timed step's optimizer step: (wall, main thread's CPU) s
        self._start: tuple[float, float] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.warmup <= trainer.global_step < self.measure_step:
            self._start = (time.perf_counter(), time.thread_time())
        if trainer.global_step == self.measure_step and self.counter is None and not self.result:
            self.counter = ExactCounter()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is not None:
            self.times.append((time.perf_counter() - self._start[0], time.thread_time() - self._start[1]))
            self._start = None
        if self.counter is None:
            return
        counter, self.counter = self.counter, None
        counter.__exit__(None, None, None)
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "_optimizer", optimizer)
        self.result = {
            "optimizer": type(inner).__name__,
            "step_sent_bytes": counter.exact_sent,  # every collective of the optimizer step
            "all_to_all_sent_bytes": counter.all_to_all_sent,
            "by_kind": {k: v["sent_bytes"] for k, v in counter.by_kind().items()},
            "formula_bytes": exchange_formula(optimizer),
            "reported": dict(getattr(inner, "exchange", {})),  # MuonAdamW's own record of the step
            # the optimizer step's medians over the timed steps (before this one)
            "step_wall_s": median(t[0] for t in self.times) if self.times else None,
            "step_cpu_s": median(t[1] for t in self.times) if self.times else None,
        }

    def on_exception(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.counter = None
