"""A pipeline step of many microbatches simulated from a shorter one: the rank runs the schedule over ``2 * pp``
microbatches of the real size, and what it counted (collectives, FLOPs) is extended to the configured count.

Why this is exact for counts: under 1F1B and interleaved 1F1B every microbatch past the first and before the last
issues the same operations (its stages' forward and backward, the schedule's sends and receives of its activations
and gradients, its loss); the first microbatch adds what happens once a step inside the schedule (ZeRO-3's
gathers with ``reshard_after_forward=False``, the warm-up vote), the last the once-a-step reductions of its last
backward; the data-parallel reduction, clipping and optimizer step come after the schedule, once. So each
operation's count in a step of ``M`` microbatches is its count in the shorter step plus ``M - M'`` times its count
in one middle microbatch, and likewise the FLOPs. Each operation is attributed to its microbatch
(:class:`MicrobatchTags`): those a stage issues inside its forward or backward of a microbatch, the loss of it,
and the schedule's sends and receives of its activations and gradients (told apart by the tensor they carry).

Why the activations need no scaling: at ``2 * pp`` microbatches a multiple of ``pp``, both schedules are in their
steady state, and the microbatches in flight are what they are at any larger multiple of ``pp``: 1F1B's first
stage holds ``pp`` microbatches (warm-up ``pp - 1 - stage`` forwards, then one forward and one backward), torch's
interleaved 1F1B ``(v - 1) * pp + 2 * (pp - 1 - rank) + 1`` chunks of ``1/v`` of the rank's layers (``v`` stages
per rank, microbatches in rounds of ``pp``). The memory tracker reads them as they are. GPipe (every microbatch
in flight), the breadth-first and zero-bubble schedules, and counts not a multiple of ``pp`` run in full.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from torch import Tensor

from lightning_parallel._compat import tree_leaves
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.simulate.trace import Collective, TraceRecorder

SCALED_SCHEDULES = ("1f1b", "interleaved_1f1b")


def reduced_microbatches(config: ParallelConfig) -> int | None:
    """The microbatches a rank of ``config`` runs when its step is extended from a shorter one (``2 * pp``), or
    None when the step runs in full (no pp, another schedule, few microbatches, a count not a multiple of pp)."""
    pp, m = config.pp, config.microbatches or 0
    if pp <= 1 or config.pp_schedule not in SCALED_SCHEDULES or m <= 2 * pp or m % pp:
        return None
    return 2 * pp


class MicrobatchTags:
    """Attributes each operation and FLOP of a pipeline step to its microbatch (None: once a step).

    The stages call :meth:`enter` and :meth:`leave` around each forward, backward and loss of a microbatch, and
    :meth:`p2p` for the sends and receives the schedule makes for one; ``recorder`` reads :attr:`current` and the
    tensors' tags as it records.
    """

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder, self.counter = recorder, None
        self.flops: Counter[int | None] = Counter()
        self._mark, self._outer = 0, []
        recorder.tagger = self

    @property
    def current(self) -> int | None:
        return self._outer[-1] if self._outer else None

    def begin_step(self, counter: Any) -> None:
        """A new step, its FLOPs counted by ``counter`` (a ``LocalFlopCounter``)."""
        self.counter, self._mark, self._outer = counter, 0, []
        self.flops.clear()

    def _flush(self) -> None:
        if self.counter is not None:
            self.flops[self.current] += self.counter.flops - self._mark
            self._mark = self.counter.flops

    def enter(self, microbatch: int) -> None:
        self._flush()
        self._outer.append(microbatch)

    def leave(self) -> None:
        self._flush()
        self._outer.pop()

    def end_step(self) -> None:
        self._flush()

    def p2p(self, ops: list[Any], microbatch: int) -> list[Any]:
        """The schedule's ``P2POp`` list for ``microbatch``: their tensors noted, the list back."""
        for op in ops:
            self.recorder.p2p_tags[id(op.tensor)] = microbatch
        return ops


def held_per_microbatch(stages: list[Any], batch: Any, ran: int) -> int:
    """Bytes a step holds for each of its microbatches whatever the schedule: torch's receive buffers of one
    microbatch (each stage allocates its activations' and gradients' buffers for every microbatch of the step at
    the first step) and one microbatch's share of the batch (tokens and targets)."""
    held = 0
    for stage in stages:
        for infos in (stage.args_recv_info.get(0, ()), stage.grad_recv_info.get(0, ())):
            held += sum(i.buffer.nbytes for i in infos or () if getattr(i, "buffer", None) is not None)
    tensors = [t for t in tree_leaves(list(batch)) if isinstance(t, Tensor)]
    return held + sum(t.nbytes for t in tensors) // ran


def _key(c: Collective) -> tuple[Any, ...]:
    return (c.op, c.axes, c.dtype, c.shape, c.payload_bytes, c.ranks, c.peer)


def scale_step(
    ops: list[Collective], tags: list[int | None], flops: Counter, held: int, microbatches: int, ran: int
) -> tuple[list[Collective], int, int, bool]:
    """The step of ``microbatches`` from the one of ``ran`` simulated: each distinct operation once, with its
    ``count``; the FLOPs; the bytes the longer step holds more (``held`` per microbatch,
    :func:`held_per_microbatch`); whether every middle microbatch issued the same operations (the premise)."""
    middle = ran // 2
    per: dict[int | None, Counter] = {}
    for c, tag in zip(ops, tags):
        per.setdefault(tag, Counter())[_key(c)] += 1
    steady = per.get(middle, Counter())
    agree = all(per.get(k, Counter()) == steady for k in range(1, ran - 1))
    first: dict[tuple[Any, ...], Collective] = {}
    total: Counter = Counter()
    for c in ops:
        first.setdefault(_key(c), c)
        total[_key(c)] += c.count
    more = microbatches - ran
    scaled = [dataclasses.replace(c, count=total[k] + steady[k] * more) for k, c in first.items()]
    return scaled, sum(flops.values()) + flops[middle] * more, held * more, agree
