"""The worker's side of ``make bench``'s Muon section (benchmarks/muon.py): the bytes one optimizer step sends,
counted at torch's dispatcher, and the same bytes by the formula of parallel/optim/muon_exchange.py, computed from
the optimizer's own parameters and owner assignment (:func:`~lightning_parallel.parallel.optim.muon_exchange.owners`).

Counted: every collective issued between ``on_before_optimizer_step`` and the end of the monitor's measured step
(the optimizer step alone: the gradients are reduced before it). The optimizer step's wall and CPU time (the
main thread's) are taken on the timed steps before it. An ``all_to_all_single`` counts exactly the
elements this rank sends to the other ranks (its input splits but its own); the other collectives as
parallel/measure/comm_volume.py counts them (an even all-gather: exactly what a rank sends).

Formula, per group that splits Muon matrices (``W`` ranks, this rank ``r``, ``n[m][q]`` the elements of matrix
``m`` on rank ``q``, ``b`` the Newton-Schulz dtype's element size)::

    b * ( sum over m not owned by r of n[m][r]  +  sum over m owned by r of (|m| - n[m][r]) )

with the owners ``owners([|m| ...], W)`` gives; a matrix split on two mesh dimensions (dp x tp ZeRO-3) is gathered
whole on each of its ``k`` ranks in its own dtype (``full_tensor``): ``|m| (1 - 1/k)`` elements per rank.
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
from lightning_parallel.parallel.optim.muon_exchange import chunk_sizes, owners


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


def _owner_bytes(numels: list[list[int]], group: Any) -> int:
    """Elements this rank sends in the owner exchange of one group: the formula of the module docstring."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = owners([sum(n) for n in numels], world)
    return sum(sum(n) - n[rank] if owner[m] == rank else n[rank] for m, n in enumerate(numels))


def exchange_formula(optimizer: Any) -> int:
    """Bytes this rank sends in one Muon step, by the formula (0 for an optimizer that is not Muon's)."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(opt, MuonAdamW):
        return 0
    total = 0
    for group in (g for g in opt.param_groups if g["use_muon"]):
        width = torch.finfo(NS_DTYPES.get(group["ns_dtype"], group["ns_dtype"])).bits // 8
        split: dict[int, tuple[Any, list[list[int]]]] = {}  # process group -> its matrices' elements per rank
        for p in group["params"]:
            if id(p) in opt.flat_layouts:  # ZeRO-1/2: the matrices' segments of this flat slice
                layout = opt.flat_layouts[id(p)]
                world = dist.get_world_size(layout.group)
                numels = [[max(0, hi - lo) for lo, hi in layout.segments(m, world)] for m in range(len(layout.shapes))]
                total += width * _owner_bytes(numels, layout.group)
                continue
            if not isinstance(p, DTensor):
                continue  # whole on every rank: nothing sent
            dims = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate()]
            if len(dims) == 1 and type(dims[0][1]) is Shard:
                mesh_dim, dim = dims[0][0], dims[0][1].dim
                pg = p.device_mesh.get_group(mesh_dim)
                rows = [n * (p.numel() // p.shape[dim]) for n in chunk_sizes(p.shape[dim], dist.get_world_size(pg))]
                split.setdefault(id(pg), (pg, []))[1].append(rows)
            elif dims:  # split on several mesh dimensions: gathered whole on every rank, in the update's dtype
                ranks = 1
                for i, _ in dims:
                    ranks *= p.device_mesh.size(i)
                total += local(p).element_size() * (p.numel() - p.numel() // ranks)
        total += sum(width * _owner_bytes(numels, pg) for pg, numels in split.values())
    return total


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
