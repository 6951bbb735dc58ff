"""Host work of a training step, counted rather than timed (a loaded machine's clock says little): over a window
of steady steps, the Python calls (cProfile's ``ncalls``), the torch operators the profiler records, and the
collectives (``CommCounter``), each per step. Used by benchmarks/worker.py's ``--count`` and benchmarks/overhead.py.
:class:`HostSyncs` counts a step's host synchronisations instead (worker.py's ``--syncs``).

Each count runs over its own window of ``steps`` whole loop iterations (one batch start to the next), so no
counter's own work lands in another's window: Python calls first, then operators (with their shares of self CPU
time), then collectives (the dispatch mode that counts them is Python work on every operator).
"""

from __future__ import annotations

import cProfile
import pstats
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_parallel.parallel.measure.comm_volume import CommCounter
from lightning_parallel.parallel.measure.host_sync import HostSyncCounter

# where a Python function lives, by the first of these its file path contains
PACKAGES = ("lightning_parallel", "lightning", "torch")


def _package(filename: str) -> str:
    for name in PACKAGES:
        if f"/{name}/" in filename:
            return name
    return "builtin" if filename == "~" else "other"


class HostCounts(pl.Callback):
    """Per-step counts over three windows of ``steps`` iterations each, the first starting at batch ``start``.

    Args:
        start: the first counted batch (after warm-up).
        steps: iterations per window.
    """

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.result: dict[str, Any] = {}
        self._python: cProfile.Profile | None = None
        self._profiler: Any = None
        self._comm: CommCounter | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            self._python = cProfile.Profile()
            self._python.enable()
        elif batch_idx == self.start + self.steps:
            self._stop_python()
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()
        elif batch_idx == self.start + 2 * self.steps:
            self._stop_ops()
            self._comm = CommCounter()
            self._comm.__enter__()
        elif batch_idx == self.start + 3 * self.steps:
            self._stop_comm()

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._stop_python()  # a run shorter than the windows: counted over what ran (result["steps"] says so)
        self._stop_ops()
        self._stop_comm()

    def _stop_python(self) -> None:
        if self._python is None:
            return
        self._python.disable()
        stats = pstats.Stats(self._python).stats  # (file, line, name) -> (primitive, ncalls, tottime, cumtime, ...)
        self._python = None
        by_package: Counter[str] = Counter()
        ours: Counter[str] = Counter()
        every: Counter[str] = Counter()
        for (filename, line, name), (_, ncalls, *_rest) in stats.items():
            package = _package(filename)
            by_package[package] += ncalls
            every[f"{'/'.join(filename.split('/')[-2:])}:{line}({name})"] += ncalls
            if package == "lightning_parallel":
                ours[f"{filename.split('lightning_parallel/')[-1]}:{line}({name})"] += ncalls
        n = self.steps
        self.result["python_calls"] = sum(by_package.values()) / n
        self.result["python_calls_by_package"] = {k: v / n for k, v in by_package.most_common()}
        self.result["top_ours"] = [(k, v / n) for k, v in ours.most_common(15)]
        self.result["top_all"] = [(k, v / n) for k, v in every.most_common(40)]

    def _stop_ops(self) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        n = self.steps
        events = Counter(e.name for e in self._profiler.events())
        self.result["torch_ops"] = sum(v for k, v in events.items() if k.startswith("aten::")) / n
        self.result["profiler_events"] = sum(events.values()) / n
        self.result["self_cpu_share"] = _self_cpu_shares(self._profiler)
        self._profiler = None

    def _stop_comm(self) -> None:
        if self._comm is None:
            return
        self._comm.__exit__(None, None, None)
        n = self.steps
        self.result["collectives"] = {k: row["calls"] / n for k, row in self._comm.by_kind().items()}
        self.result["collective_calls"] = len(self._comm.events) / n
        sizes = Counter(f"{e.kind}@{e.group_size}" for e in self._comm.events)
        self.result["collectives_by_group_size"] = {k: v / n for k, v in sorted(sizes.items())}
        self.result["steps"] = n
        self._comm = None


def _self_cpu_shares(profiler: Any, top: int = 12) -> list[tuple[str, float]]:
    """The operators' shares of the window's self CPU time (fractions, not timings: on a loaded machine only the
    proportions say where host work goes), largest first."""
    averages = profiler.key_averages()
    total = sum(a.self_cpu_time_total for a in averages) or 1.0
    ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return [(a.key, round(a.self_cpu_time_total / total, 4)) for a in ranked]


class HostSyncs(pl.Callback):
    """The host synchronisations of ``steps`` whole loop iterations (one batch start to the next), from batch
    ``start`` on (:class:`~lightning_parallel.parallel.measure.host_sync.HostSyncCounter`), per step: ``result``
    holds the total and each source line's calls by kind and package. First in the callback list: its modes must
    be left before another callback enters its own at the same batch start."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.result: dict[str, Any] = {}
        self._counter: HostSyncCounter | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            self._counter = HostSyncCounter().__enter__()
        elif batch_idx == self.start + self.steps:
            self._stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        n, sites = self.steps, self._counter.by_site()
        self.result = {
            "steps": n,
            "per_step": len(self._counter.events) / n,
            "by_package": {k: v / n for k, v in Counter(e.package for e in self._counter.events).items()},
            "sites": [
                {"kind": kind, "site": site, "package": package, "via": via, "per_step": calls / n}
                for (kind, site, package, via), calls in sites.most_common()
            ],
        }
        self._counter = None
