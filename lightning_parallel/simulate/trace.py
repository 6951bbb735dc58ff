"""Every collective and point-to-point op a simulated rank issues, in order, and the check that the ranks of each
process group issue the same sequence (the mismatch that hangs NCCL: one rank in an all-gather its peers never
join, or joining with another shape).

Recorded at the dispatcher by :class:`~lightning_parallel.parallel.measure.comm_volume.CommCounter` (c10d ops:
``dist.*``, FSDP2, ZeRO's flat buffers, pipeline send/recv; functional ops: DTensor's tensor parallelism), which
the fake process group's ops go through as a real backend's do; this recorder adds each op's tensor shape and its
group's members.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

from lightning_parallel._compat import tree_leaves
from lightning_parallel.parallel.measure.comm_volume import CommCounter
from lightning_parallel.simulate.world import GroupInfo


@dataclass(frozen=True)
class Collective:
    """One op as one rank issued it.

    Attributes:
        op: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
        axes: the mesh axes of its group (``tp``, ``dp_ep``, ``world``).
        dtype: of its tensors.
        shape: of its first tensor as this rank passed it (the input; a functional all-gather's shard).
        payload_bytes: the bytes of the op as ``comm_volume.py`` counts them (an all-gather's whole output).
        sent_bytes: what this rank sends under ``comm_volume.py``'s convention (a ring's bus bytes).
        group_size: ranks in its group.
        ranks: its group's members (global ranks).
        stride: global ranks between neighbouring members (whether it stays inside a node).
        step: the training step it belongs to (0 first).
        peer: a send's destination or a receive's source (global rank; None for collectives, and for the
            point-to-point ops strict mode issues off the dispatcher).
        count: how many times the step issues it (1; more in a pipeline step extended from a shorter one:
            :mod:`~lightning_parallel.simulate.scaling`).
    """

    op: str
    axes: str
    dtype: str
    shape: tuple[int, ...]
    payload_bytes: int
    sent_bytes: float
    group_size: int
    ranks: tuple[int, ...]
    stride: int
    step: int
    peer: int | None = None
    count: int = 1

    def key(self) -> tuple[Any, ...]:
        """What the ranks of its group must agree on: operation, shape and dtype (in order)."""
        return (self.op, self.shape, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"], out["ranks"] = list(self.shape), [self.ranks[0], self.ranks[-1]] if self.ranks else []
        return out


class TraceRecorder(CommCounter):
    """A :class:`CommCounter` that also notes each op's first tensor shape (``shapes``, parallel to ``events``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.steps: list[int] = []
        self.peers: list[int | None] = []  # a send's or receive's peer, its rank in the op's group
        self.tags: list[int | None] = []  # the pipeline microbatch each op belongs to (None: once a step)
        self.tagger: Any = None  # simulate/scaling.py's MicrobatchTags, when the step is extended
        self.p2p_tags: dict[int, int] = {}  # id of a tensor the schedule sends or receives -> its microbatch
        self.step = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.events) > before:
            first = next((t for t in tree_leaves(list(args)) if isinstance(t, Tensor)), None)
            self.shapes.append(tuple(first.shape) if first is not None else ())
            self.steps.append(self.step)
            p2p = self.events[-1].kind in ("send", "recv") and len(args) > 2 and isinstance(args[2], int)
            self.peers.append(args[2] if p2p else None)
            self.tags.append(self._tag(first))
        return out

    def _tag(self, first: Tensor | None) -> int | None:
        if self.tagger is None:
            return None
        carried = self.p2p_tags.pop(id(first), None) if first is not None else None
        return carried if carried is not None else self.tagger.current

    def _strict_p2p(self, entry: Any) -> None:  # strict mode's send / recv, noted in issue order
        super()._strict_p2p(entry)
        self.shapes.append(tuple(entry.shapes[0]) if entry.shapes else ())
        self.steps.append(self.step)
        self.peers.append(None)
        self.tags.append(self._tag(None))

    def collectives(self, groups: dict[str, GroupInfo]) -> list[Collective]:
        """The ops so far, their groups named by ``groups`` (:meth:`SimulatedWorld.groups`)."""
        out = []
        for event, shape, step, peer in zip(self.events, self.shapes, self.steps, self.peers):
            info = groups.get(event.group, GroupInfo("other", (), 1))
            if peer is not None:
                peer = info.ranks[peer] if peer < len(info.ranks) else None
            out.append(
                Collective(
                    event.kind,
                    info.axes,
                    event.dtype,
                    shape,
                    event.payload_bytes,
                    event.sent_bytes,
                    event.group_size,
                    info.ranks,
                    info.stride,
                    step,
                    peer,
                )
            )
        return out


@dataclass(frozen=True)
class Mismatch:
    """Two ranks of one group whose sequences on it part: the first differing op (None: one sequence ended)."""

    axes: str
    ranks: tuple[int, ...]
    first: int
    second: int
    index: int
    first_op: tuple[Any, ...] | None
    second_op: tuple[Any, ...] | None

    def describe(self) -> str:
        return (
            f"group {self.axes} (ranks {self.ranks[0]}..{self.ranks[-1]}): op #{self.index} is {self.first_op} on "
            f"rank {self.first} but {self.second_op} on rank {self.second}"
        )


def check_consistency(traces: dict[int, list[Collective]]) -> tuple[list[Mismatch], int]:
    """Compare, for every process group two or more simulated ranks belong to, their sequences of collectives on
    it; and for every two simulated ranks with point-to-point traffic between them, the sender's sends to the
    receiver with the receiver's receives from the sender (shape and dtype, in order: a pipeline's activations and
    gradients). Returns the mismatches and the number of groups and pairs compared."""
    by_group: dict[tuple[str, tuple[int, ...]], dict[int, list[tuple[Any, ...]]]] = {}
    for rank, ops in traces.items():
        for c in ops:
            if c.op not in ("send", "recv") and c.ranks:
                by_group.setdefault((c.axes, c.ranks), {}).setdefault(rank, []).append(c.key())
    mismatches, compared = [], 0
    for (axes, ranks), seqs in sorted(by_group.items()):
        if len(seqs) < 2:
            continue
        compared += 1
        (first, reference), *others = sorted(seqs.items())
        for other, seq in others:
            found = _first_difference(reference, seq)
            if found is not None:
                a = reference[found] if found < len(reference) else None
                b = seq[found] if found < len(seq) else None
                mismatches.append(Mismatch(axes, ranks, first, other, found, a, b))
    for sender, receiver in sorted(_pairs(traces)):
        compared += 1
        sent = [c for c in traces[sender] if c.op == "send" and c.peer == receiver]
        received = [c for c in traces[receiver] if c.op == "recv" and c.peer == sender]
        found = _first_difference([c.key()[1:] for c in sent], [c.key()[1:] for c in received])
        if found is not None:
            a = ("send", *sent[found].key()[1:]) if found < len(sent) else None
            b = ("recv", *received[found].key()[1:]) if found < len(received) else None
            axes = (sent or received)[0].axes
            mismatches.append(Mismatch(axes, (sender, receiver), sender, receiver, found, a, b))
    return mismatches, compared


def _pairs(traces: dict[int, list[Collective]]) -> set[tuple[int, int]]:
    """(sender, receiver) pairs of simulated ranks with point-to-point traffic between them (known peers)."""
    return {
        (rank, c.peer) if c.op == "send" else (c.peer, rank)
        for rank, ops in traces.items()
        for c in ops
        if c.op in ("send", "recv") and c.peer is not None and c.peer in traces and c.peer != rank
    }


def _first_difference(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
