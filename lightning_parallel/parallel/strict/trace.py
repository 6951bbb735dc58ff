"""Every rank of a group issues the same collectives in the same order, shapes and dtypes: a trace, compared. Pure
torch.

Each collective this rank issues through ``torch.distributed`` or its functional collectives (DTensor's) is
recorded per process group as an :class:`Entry` (operation, shapes, dtype, payload bytes); point-to-point ops are
recorded too (their pairing is checked as they run: :mod:`.p2p`). At a checkpoint (:func:`compare`: the end of a
Trainer run, the end of the process) every rank publishes its entries since the last checkpoint through the
rendezvous store and compares each group's with the group's lowest rank's (its second lowest's, on the lowest
rank): the first difference is raised, named. The payload bytes follow :mod:`~lightning_parallel.parallel.measure.
comm_volume`'s convention (an all-gather: the gathered whole; a reduce-scatter: the whole input).
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_parallel._compat import tree_leaves

_KEEP = 200_000  # entries kept per group between checkpoints (beyond: counted and hashed only)


@dataclass(frozen=True)
class Entry:
    """One operation as this rank issued it."""

    op: str  # torch's function name, "funcol." for a functional collective; "send"/"recv" for p2p
    group: str
    shapes: tuple[tuple[int, ...], ...]  # of the payload's tensors; () where ranks may differ (uneven ops)
    dtype: str
    bytes: int
    uneven: bool = False  # sizes may differ across ranks (all_to_all's splits, a list gather): not compared

    def comparable(self) -> tuple:
        """What every rank of the group must agree on."""
        return self.op, self.group, self.shapes, self.dtype, None if self.uneven else self.bytes

    def describe(self) -> str:
        return f"{self.op}(shapes={list(self.shapes)}, dtype={self.dtype}, bytes={self.bytes})"


def payload(x: Any) -> tuple[tuple[tuple[int, ...], ...], str, int]:
    """The shapes, first dtype and bytes of the tensors in ``x`` (a tensor or a list of them)."""
    tensors = [t for t in tree_leaves(x) if isinstance(t, Tensor)]
    dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else ""
    return tuple(tuple(t.shape) for t in tensors), dtype, sum(t.numel() * t.element_size() for t in tensors)


class Trace:
    """This rank's entries per group since the last checkpoint, with every group's ranks."""

    def __init__(self) -> None:
        self.entries: dict[str, list[Entry]] = {}
        self.counts: dict[str, int] = {}
        self.digests: dict[str, Any] = {}
        self.ranks: dict[str, tuple[int, ...]] = {}
        self.recorders: list[list[Entry]] = []
        self.checkpoints = 0

    def add(self, entry: Entry, ranks: tuple[int, ...]) -> None:
        for recorder in self.recorders:
            recorder.append(entry)
        if entry.op in ("send", "recv"):
            return  # paired as they run; the sides' traces differ by nature
        name = entry.group
        self.ranks.setdefault(name, ranks)
        kept = self.entries.setdefault(name, [])
        self.counts[name] = self.counts.get(name, 0) + 1
        self.digests.setdefault(name, hashlib.blake2b(digest_size=16)).update(pickle.dumps(entry.comparable()))
        if len(kept) < _KEEP:
            kept.append(entry)

    def summary(self) -> dict[str, tuple[tuple[int, ...], int, bytes]]:
        return {g: (self.ranks[g], self.counts[g], self.digests[g].digest()) for g in self.entries}


def compare(trace: Trace, store: Any, rank: int, world: int, where: str, timeout_s: float) -> None:
    """Publish this rank's trace, compare each of its groups with a reference rank's, and start a new segment.

    Raises:
        StrictCollectiveError: at the first operation where two ranks of a group differ.
    """
    from lightning_parallel.parallel.strict.p2p import StrictCollectiveError

    n = trace.checkpoints
    trace.checkpoints += 1
    mine = trace.summary()
    store.set(f"lp_strict/sum/{n}/{rank}", pickle.dumps(mine))
    store.set(f"lp_strict/trace/{n}/{rank}", pickle.dumps(trace.entries))
    entries = trace.entries
    trace.entries, trace.counts, trace.digests = {}, {}, {}
    theirs = _gather(store, n, [r for r in range(world) if r != rank], timeout_s)
    groups = dict(mine)
    for summary in theirs.values():  # a group another member used and this rank never did
        groups.update({g: s for g, s in summary.items() if rank in s[0] and g not in groups})
    for name, (ranks, _, _) in sorted(groups.items()):
        others = [r for r in ranks if r != rank and r in theirs]
        if not others:
            continue
        ref = others[0]
        if theirs[ref].get(name, (None, 0, b""))[1:] == mine.get(name, (None, 0, b""))[1:]:
            continue
        ref_entries = pickle.loads(store.get(f"lp_strict/trace/{n}/{ref}")).get(name, [])
        raise StrictCollectiveError(_difference(name, ranks, rank, entries.get(name, []), ref, ref_entries, where))


def _gather(store: Any, n: int, ranks: list[int], timeout_s: float) -> dict[int, dict]:
    """The other ranks' summaries; a rank that ended on an error (``lp_strict/abandoned``) or never came is left
    out (its own failure is reported elsewhere)."""
    out, deadline, left = {}, time.monotonic() + timeout_s, list(ranks)
    while left and time.monotonic() < deadline:
        for r in list(left):
            if store.check([f"lp_strict/sum/{n}/{r}"]):
                out[r] = pickle.loads(store.get(f"lp_strict/sum/{n}/{r}"))
                left.remove(r)
            elif store.check([f"lp_strict/abandoned/{r}"]):
                left.remove(r)
        if left:
            time.sleep(0.05)
    return out


def _difference(name: str, ranks: tuple, me: int, mine: list[Entry], ref: int, theirs: list[Entry], where: str) -> str:
    head = f"strict collectives: group {name} (ranks {list(ranks)}) at {where}: "
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a.comparable() != b.comparable():
            return (
                f"{head}operation #{i} differs: rank {me} issued {a.describe()}, rank {ref} issued {b.describe()}. "
                "On NCCL every rank of a group must issue the same collectives in the same order, shapes and dtypes "
                "(else a hang or a corrupt result)."
            )
    if len(mine) != len(theirs):
        longer, extra = (me, mine) if len(mine) > len(theirs) else (ref, theirs)
        return (
            f"{head}rank {me} issued {len(mine)} operations, rank {ref} {len(theirs)}; the first extra one, on rank "
            f"{longer}: {extra[min(len(mine), len(theirs))].describe()} (on NCCL: a hang)."
        )
    return f"{head}the traces differ after the first {_KEEP} operations kept (their hashes differ)."
