"""Point-to-point operations kept to NCCL's order on gloo. Pure torch.

NCCL runs the operations between two ranks of a communicator in the order they were issued (one stream per pair),
and a send completes only once the peer's matching receive runs: no buffering. gloo buffers a send until its
receive comes, so an order that deadlocks on a GPU passes on CPU. Here every ``isend``/``irecv`` (and ``send``,
``recv``, ``batch_isend_irecv``) on a CPU tensor becomes a *unit* queued on a per-(group, peer) executor thread that
runs the units of the pair one at a time, in issue order:

- on reaching a unit, the executor announces each of its receives through the rendezvous store
  (``ack/<group>/<src>><dst>/<k>``: the k-th receive of ``dst`` from ``src`` runs now) and posts the real receive;
- each send waits for the announcement of its matching receive (the k-th send matches the k-th receive, as NCCL
  matches them), is posted, and says so (``sent/...``); each receive then waits for that word from its send. The ops
  of one ``batch_isend_irecv`` form one unit, so they progress together as an NCCL group call does; a unit spanning
  several peers completes when all its parts have;
- a pair that waits publishes what it waits for (``blocked/<group>/<src>><dst>``); when the peer waits in turn for
  an operation of ours that lies behind the one we wait on, each waits for the other: NCCL's deadlock, raised at
  once (within ``_SLICE_S``) as :class:`StrictCollectiveError` naming the ranks, the group and each side's pending
  operations. Any other wait longer than the strict timeout is raised the same way.

The caller gets a :class:`StrictWork` for each op; its ``wait`` blocks until the unit ran (as a GPU's stream would
wait) and raises the executor's error.
"""

from __future__ import annotations

import pickle
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

_SLICE_S = 2.0  # a blocked send looks for a mutual wait this often
_DEADLOCK = b"lp-strict-deadlock:"  # a key's value that carries the peer's report instead of the op's word


class StrictCollectiveError(RuntimeError):
    """An order NCCL would not run (deadlock, mismatched operations), found by strict mode."""


@dataclass
class P2P:
    """One point-to-point operation as this rank issued it."""

    kind: str  # "send" or "recv"
    tensor: Tensor
    peer: int  # global rank
    group: Any
    group_name: str
    tag: int
    index: int = 0  # the k-th op of this kind between this rank and ``peer`` in the group (from 1)

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        shape = "x".join(map(str, self.tensor.shape)) or "scalar"
        return f"{self.kind} #{self.index} {way} rank {self.peer} ({shape} {self.tensor.dtype}, tag {self.tag})"

    def meta(self) -> tuple[str, int]:
        return str(self.tensor.dtype), self.tensor.numel()


class Unit:
    """One issued call (an op, or one ``batch_isend_irecv``): its ops grouped by peer, done when every part is."""

    def __init__(self, ops: list[P2P]) -> None:
        self.parts: dict[tuple[str, int], list[P2P]] = {}
        for op in ops:
            self.parts.setdefault((op.group_name, op.peer), []).append(op)
        self._left = len(self.parts)
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.delivered = False  # the error was raised to a caller waiting for it

    def describe(self) -> str:
        ops = [op.describe() for part in self.parts.values() for op in part]
        return ops[0] if len(ops) == 1 else "batch_isend_irecv[" + ", ".join(ops) + "]"

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left <= 0 or error is not None:
                self.done.set()


class StrictWork:
    """What ``isend``/``irecv`` return under strict mode: ``wait`` blocks until the op's unit ran."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self, timeout: Any = None) -> bool:
        self._unit.done.wait()
        if self._unit.error is not None:
            self._unit.delivered = True
            raise self._unit.error
        return True

    def is_completed(self) -> bool:
        return self._unit.done.is_set()

    def is_success(self) -> bool:
        return self._unit.done.is_set() and self._unit.error is None

    def exception(self) -> BaseException | None:
        return self._unit.error

    def result(self) -> list[Tensor]:
        self.wait()
        return []

    def get_future(self) -> Any:
        import torch

        future: Any = torch.futures.Future()

        def settle() -> None:
            self._unit.done.wait()
            if self._unit.error is not None:
                future.set_exception(self._unit.error)
            else:
                future.set_result([])

        threading.Thread(target=settle, daemon=True).start()
        return future


class Pair:
    """The executor of the operations between this rank and one peer in one group (NCCL's per-pair stream)."""

    def __init__(self, hub: Any, group_name: str, me: int, peer: int) -> None:
        self.hub, self.group_name, self.me, self.peer = hub, group_name, me, peer
        self.store = hub.store.clone()  # a connection of its own: a blocked wait holds its client's lock
        self.units: queue.SimpleQueue[Unit] = queue.SimpleQueue()
        self.pending: deque[Unit] = deque()  # issued, not yet run (under hub.lock)
        self.acked = 0  # receives from ``peer`` announced so far
        self.sent = 0  # sends to ``peer`` posted so far
        threading.Thread(target=self._loop, name=f"lp-strict-{group_name}-{peer}", daemon=True).start()

    def put(self, unit: Unit) -> None:
        self.pending.append(unit)
        self.units.put(unit)

    def describe_pending(self) -> str:
        with self.hub.lock:
            units = list(self.pending)
        return "; ".join(u.describe() for u in units) or "nothing"

    def _loop(self) -> None:
        while True:
            unit = self.units.get()
            try:
                if self.hub.error is not None:
                    raise self.hub.error
                self._run(unit.parts[(self.group_name, self.peer)])
                unit.part_done()
                unit.done.wait()  # a group call's later ops wait for all of it, on every pair it spans
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                self.hub.fail(error)
                self.hub.failed.append(unit)
                unit.part_done(error)
            finally:
                with self.hub.lock:
                    self.pending.popleft()

    def _run(self, ops: list[P2P]) -> None:
        """Announce the receives and post them; post each send once its receive runs; wait until each receive's
        send was posted; then the real transfers complete (gloo's send waits for its posted receive)."""
        originals, works, receives = self.hub.originals, [], []
        for op in ops:
            if op.kind == "recv":
                self.store.set(_key("ack", op.group_name, op.peer, self.me, op.index), pickle.dumps(op.meta()))
                self.acked = op.index
                receives.append(op)
                works.append(originals["irecv"](op.tensor, op.peer, group=op.group, tag=op.tag))
        for op in ops:
            if op.kind == "send":
                theirs = self._await(op, _key("ack", op.group_name, self.me, op.peer, op.index), "recv")
                self._check_sizes(op, pickle.loads(theirs))
                works.append(originals["isend"](op.tensor, op.peer, group=op.group, tag=op.tag))
                self.store.set(_key("sent", op.group_name, self.me, op.peer, op.index), b"1")
                self.sent = op.index
        for op in receives:
            self._await(op, _key("sent", op.group_name, op.peer, self.me, op.index), "send")
        for work in works:
            work.wait()

    def _await(self, op: P2P, key: str, awaited: str) -> bytes:
        """The value of ``key``: the peer's matching op (``awaited``: its kind) runs. Meanwhile this pair says what
        it waits for, and looks whether the peer waits for this rank in turn (see :meth:`_raise_if_mutual`)."""
        blocked = _key("blocked", op.group_name, self.me, op.peer)
        started, published = time.monotonic(), False
        while not self.store.check([key]):
            if not published:
                self.store.set(blocked, pickle.dumps((awaited, op.index, self.describe_pending())))
                published = True
            self._raise_if_mutual(op, key, awaited, started)
            try:
                self.store.wait([key], timedelta(seconds=_SLICE_S))
            except dist.DistStoreError:
                pass
        if published:  # overwritten, never deleted: a peer between its check and its get would wait for it
            self.store.set(blocked, pickle.dumps(None))
        value = self.store.get(key)
        self.store.delete_key(key)
        if value.startswith(_DEADLOCK):  # the peer found the mutual wait first and woke us with its report
            raise StrictCollectiveError(value[len(_DEADLOCK) :].decode())
        return value

    def _check_sizes(self, op: P2P, theirs: tuple[str, int]) -> None:
        if theirs != op.meta():
            raise StrictCollectiveError(
                f"strict collectives: group {op.group_name}: rank {self.me}'s {op.describe()} meets rank "
                f"{op.peer}'s receive of {theirs[1]} {theirs[0]} elements: on NCCL the sizes must match (else a "
                "hang or a corrupt tensor) and the dtypes too."
            )

    def _raise_if_mutual(self, op: P2P, key: str, awaited: str, started: float) -> None:
        """Raise when the peer waits for an op of this rank that lies behind the one this rank waits on (each waits
        for the other: NCCL's deadlock), or after the strict timeout."""
        peer_blocked = _key("blocked", op.group_name, op.peer, self.me)
        theirs = (
            pickle.loads(self.store.get(peer_blocked) or pickle.dumps(None))
            if self.store.check([peer_blocked])
            else None
        )
        waited = time.monotonic() - started
        # the peer waits for our receive (send) #j: not announced (posted) yet, it lies behind the op we wait on
        mutual = theirs is not None and theirs[1] > (self.acked if theirs[0] == "recv" else self.sent)
        if mutual and self.store.check([key]):
            return  # what we wait for came while we read theirs: they wait for the op we are about to post
        if not mutual and waited < self.hub.timeout_s:
            return
        ranks = list(self.hub.group_ranks(op.group_name))
        state = "wait for each other" if mutual else f"stalled {waited:.0f} s"
        head = (
            f"strict collectives: ranks {self.me} and {op.peer} of group {op.group_name} (ranks {ranks}) {state}: "
            f"rank {self.me}'s {op.describe()} waits for its matching {awaited} on rank {op.peer}."
        )
        peer_side = theirs[2] if theirs is not None else "unknown (not waiting for this rank)"
        why = (
            " On NCCL the operations between two ranks run in issue order and a send completes only when its "
            "receive runs, so this order deadlocks: issue them in the same order on both ranks (a receive "
            "first where the peer sends first), or both sides' operations in one batch_isend_irecv."
            if mutual
            else f" No matching {awaited} ran within the strict timeout ({self.hub.timeout_s:.0f} s, "
            "LP_STRICT_TIMEOUT_S)."
        )
        message = (
            f"{head}\n  rank {self.me} pending with rank {op.peer}: {self.describe_pending()}"
            f"\n  rank {op.peer} pending with rank {self.me}: {peer_side}\n{why}"
        )
        if mutual:  # wake the peer where it waits (our op it waits for will never come) with the same report
            src, dst = (op.peer, self.me) if theirs[0] == "recv" else (self.me, op.peer)
            what = "ack" if theirs[0] == "recv" else "sent"
            self.store.set(_key(what, op.group_name, src, dst, theirs[1]), _DEADLOCK + message.encode())
        raise StrictCollectiveError(message)


def _key(what: str, group: str, src: int, dst: int, index: int | None = None) -> str:
    """``ack``: receive #index of dst from src runs; ``sent``: send #index of src to dst was posted; ``blocked``:
    what src's pair with dst waits for."""
    return f"lp_strict/{what}/{group}/{src}>{dst}" + (f"/{index}" if index is not None else "")


def report(error: BaseException) -> None:
    """Print an executor's error at once: the thread that will raise it may be stuck elsewhere."""
    print(f"lightning_parallel strict mode: {error}", file=sys.stderr, flush=True)
