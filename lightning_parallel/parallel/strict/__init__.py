"""Strict mode: gloo made to keep NCCL's rules, so what would hang or corrupt a GPU run fails a CPU test. Pure torch.

Turned on by ``LP_STRICT_COLLECTIVES=1`` (the strategies call :func:`enable_from_env` once their process group
exists; the test harness sets the variable for every worker); process-wide once on:

- point-to-point operations between each pair of ranks of a group run in issue order and a send completes only
  when its matching receive runs (:mod:`.p2p`); an order that deadlocks on NCCL fails within seconds, naming the
  ranks, the group and each side's pending operations (``LP_STRICT_TIMEOUT_S``, default 120, bounds any other
  wait);
- every collective and point-to-point op is traced per group (operation, shapes, dtype, bytes), and the traces of
  a group's ranks are compared at :func:`check` (the end of each Trainer run, and the end of the process): the
  first difference is raised, named (:mod:`.trace`).

On CUDA tensors (NCCL) the operations run unchanged (NCCL keeps its own order), and are traced.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from lightning_parallel._compat import default_group, default_store, funcol_group_name, resolve_process_group
from lightning_parallel.parallel.strict.p2p import P2P, Pair, StrictCollectiveError, StrictWork, Unit, report
from lightning_parallel.parallel.strict.trace import Entry, Trace, compare, payload

ENV = "LP_STRICT_COLLECTIVES"
TIMEOUT_ENV = "LP_STRICT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0

__all__ = ["ENV", "TIMEOUT_ENV", "Entry", "StrictCollectiveError", "check", "enable", "enable_from_env", "enabled"]
__all__ += ["group_ranks", "recording"]

# torch.distributed's collectives: name -> (the argument holding the payload, whether every rank's shapes match)
_COLLECTIVES = {
    "all_reduce": ("tensor", True),
    "all_reduce_coalesced": ("tensors", True),
    "all_gather": ("tensor_list", False),
    "all_gather_into_tensor": ("output_tensor", True),
    "all_gather_single": ("output_tensor", True),
    "reduce_scatter": ("input_list", False),
    "reduce_scatter_tensor": ("input", True),
    "reduce_scatter_single": ("input", True),
    "all_to_all": ("input_tensor_list", False),
    "all_to_all_single": ("input", False),
    "broadcast": ("tensor", True),
    "reduce": ("tensor", True),
    "gather": ("tensor", False),
    "scatter": ("tensor", False),
    "barrier": (None, True),
    "all_gather_object": (None, False),
    "broadcast_object_list": (None, False),
}
# functional collectives (DTensor): name -> (payload argument, shapes match, payload times the group's size)
_FUNCTIONAL = {
    "all_reduce": ("self", True, False),
    "all_reduce_coalesced": ("self", True, False),
    "all_gather_tensor": ("self", True, True),
    "all_gather_single": ("self", True, True),
    "all_gather_tensor_autograd": ("self", True, True),
    "all_gather_single_autograd": ("self", True, True),
    "reduce_scatter_tensor": ("self", True, False),
    "reduce_scatter_single": ("self", True, False),
    "reduce_scatter_tensor_autograd": ("self", True, False),
    "reduce_scatter_single_autograd": ("self", True, False),
    "all_to_all_single": ("self", False, False),
    "all_to_all_single_autograd": ("self", False, False),
    "broadcast": ("self", True, False),
}
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


class _Hub:
    """Strict mode's state in this process: the original functions, the pair executors, the trace."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.store = default_store()
        self.rank = dist.get_rank()
        self.lock = threading.Lock()
        self.pairs: dict[tuple[str, int], Pair] = {}
        self.counts: dict[tuple[str, int, str], int] = {}
        self.error: BaseException | None = None
        self.failed: list[Unit] = []  # units that ended on an error
        self.trace = Trace()
        self.originals: dict[str, Any] = {}
        self.local = threading.local()  # depth of traced calls (a collective built on another is traced once)
        self._ranks: dict[str, tuple[int, ...]] = {}

    def group_ranks(self, name: str) -> tuple[int, ...]:
        if name not in self._ranks:
            self._ranks[name] = tuple(dist.get_process_group_ranks(resolve_process_group(name)))
        return self._ranks[name]

    def delivered(self) -> bool:
        return any(unit.delivered for unit in self.failed)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            first = self.error is None
            if first:
                self.error = error
        if first:
            report(error)

    def issue(self, specs: list[tuple[str, Any, int, Any, int]]) -> list[StrictWork]:
        """Queue one unit of ``(kind, tensor, global peer, group, tag)`` ops; one work per op."""
        if self.error is not None:
            raise self.error
        ops = []
        with self.lock:
            for kind, tensor, peer, group, tag in specs:
                name = group.group_name
                key = (name, peer, kind)
                self.counts[key] = self.counts.get(key, 0) + 1
                ops.append(P2P(kind, tensor, peer, group, name, tag, self.counts[key]))
                self._note(kind, tensor, name)
            unit = Unit(ops)
            for name, peer in unit.parts:
                if (name, peer) not in self.pairs:
                    self.pairs[(name, peer)] = Pair(self, name, self.rank, peer)
                self.pairs[(name, peer)].put(unit)
        return [StrictWork(unit) for _ in ops]

    def _note(self, op: str, x: Any, group: str) -> None:
        shapes, dtype, nbytes = payload(x)
        self.trace.add(Entry(op, group, shapes, dtype, nbytes), self.group_ranks(group))


_hub: _Hub | None = None


def enabled() -> bool:
    """Whether strict mode is on in this process."""
    return _hub is not None


def enable_from_env() -> bool:
    """Turn strict mode on when ``LP_STRICT_COLLECTIVES`` is set to 1 and a default process group exists; returns
    whether it is on."""
    if dist.is_initialized() and os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
        value = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
        try:
            timeout_s = float(value)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={value!r} is not a number: set it to the strict timeout in seconds."
            ) from None
        enable(timeout_s)
    return enabled()


def enable(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Turn strict mode on in this process (idempotent). Needs the default process group (its store).

    Raises:
        ValueError: ``timeout_s`` is not positive; RuntimeError: no process group yet.
    """
    global _hub
    if timeout_s <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={timeout_s}: the strict timeout must be a positive number of seconds.")
    if _hub is not None:
        return
    if not dist.is_initialized():
        raise RuntimeError("strict mode needs the default process group: call it after init_process_group.")
    _hub = _Hub(timeout_s)
    for name in _P2P:
        _hub.originals[name] = getattr(c10d, name)
        _patch(dist, c10d, name, _P2P_WRAPPERS[name])
    for name, spec in _COLLECTIVES.items():
        if hasattr(c10d, name):
            _hub.originals[name] = getattr(c10d, name)
            _patch(dist, c10d, name, _traced(getattr(c10d, name), name, spec[0], spec[1], False, False))
    for name, (arg, same, times) in _FUNCTIONAL.items():
        _patch(funcol, None, name, _traced(getattr(funcol, name), "funcol." + name, arg, same, times, True))


def check(where: str = "a checkpoint") -> None:
    """Compare this rank's trace since the last check with its groups' other ranks' (every rank calls it at the
    same point; a no-op unless strict mode is on).

    Raises:
        StrictCollectiveError: the first operation two ranks of a group issued differently, named.
    """
    if _hub is None:
        return
    if _hub.error is not None:
        if not _hub.delivered():
            raise _hub.error  # never raised to a caller (reported on stderr only)
        return  # the run already failed on it: the traces past it mean nothing
    compare(_hub.trace, _hub.store, _hub.rank, dist.get_world_size(), where, _hub.timeout_s)


def discard() -> None:
    """Forget this rank's trace since the last check, uncompared (a run that ended on an error everywhere: its ranks
    stopped at different operations)."""
    if _hub is not None:
        _hub.trace.entries, _hub.trace.counts, _hub.trace.digests = {}, {}, {}


def abandon() -> None:
    """This rank ends on an error: the others' checks stop waiting for its trace."""
    if _hub is not None:
        _hub.store.set(f"lp_strict/abandoned/{_hub.rank}", b"1")


@contextlib.contextmanager
def recording(sink: list[Entry] | None = None) -> Iterator[list[Entry]]:
    """A list that receives every operation this rank issues inside the block, in order, as each is issued
    (``sink``: a list of the caller's, e.g. one whose ``append`` acts on each entry; strict mode must be on).

    Raises:
        RuntimeError: strict mode is off.
    """
    if _hub is None:
        raise RuntimeError(f"strict mode is off: set {ENV}=1 (or call enable()) to trace collectives.")
    recorder: list[Entry] = [] if sink is None else sink
    _hub.trace.recorders.append(recorder)
    try:
        yield recorder
    finally:
        _hub.trace.recorders.remove(recorder)


def group_ranks(name: str) -> tuple[int, ...]:
    """The global ranks of the process group named ``name`` (an :class:`Entry`'s ``group``)."""
    if _hub is None:
        return tuple(dist.get_process_group_ranks(resolve_process_group(name)))
    return _hub.group_ranks(name)


def _patch(module: Any, also: Any, name: str, wrapper: Any) -> None:
    setattr(module, name, wrapper)
    if also is not None:
        setattr(also, name, wrapper)


def _traced(fn: Any, op: str, arg: str | None, same: bool, times: bool, functional: bool) -> Any:
    signature = inspect.signature(fn)

    def traced(*args: Any, **kwargs: Any) -> Any:
        hub, local = _hub, None
        if torch.compiler.is_compiling():  # inside a compiled graph: untraced (no graph break), alike on every rank
            return fn(*args, **kwargs)
        if hub is not None and not getattr(hub.local, "depth", 0):
            local = hub.local
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            name = funcol_group_name(group) if functional else (group or default_group()).group_name
            shapes, dtype, nbytes = payload(bound.get(arg)) if arg else ((), "", 0)
            ranks = hub.group_ranks(name)
            nbytes *= len(ranks) if times else 1
            hub.trace.add(Entry(op, name, shapes if same else (), dtype, nbytes, uneven=not same), ranks)
        if local is None:
            return fn(*args, **kwargs)
        local.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            local.depth = 0

    traced.__wrapped__ = fn  # type: ignore[attr-defined]
    traced.__name__ = fn.__name__
    return traced


def _original(name: str) -> Any:
    assert _hub is not None
    return _hub.originals[name]


def _peer(group: Any, peer: int | None, group_peer: int | None) -> tuple[Any, int]:
    group = group or default_group()
    return group, peer if peer is not None else dist.get_global_rank(group, group_peer)


def _isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None):
    if _hub is None or tensor.device.type != "cpu":
        return _original("isend")(tensor, dst, group, tag, group_dst)
    group, peer = _peer(group, dst, group_dst)
    return _hub.issue([("send", tensor, peer, group, tag)])[0]


def _irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None):
    if _hub is None or tensor.device.type != "cpu" or (src is None and group_src is None):
        return _original("irecv")(tensor, src, group, tag, group_src)
    group, peer = _peer(group, src, group_src)
    return _hub.issue([("recv", tensor, peer, group, tag)])[0]


def _send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None):
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None):
    if src is None and group_src is None:
        return _original("recv")(tensor, src, group, tag, group_src)
    _irecv(tensor, src, group, tag, group_src).wait()
    return src if src is not None else dist.get_global_rank(group or default_group(), group_src)


def _batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """The ops as one unit (an NCCL group call: they progress together)."""
    assert _hub is not None
    kinds = {_hub.originals["isend"]: "send", _isend: "send", _hub.originals["irecv"]: "recv", _irecv: "recv"}
    if not p2p_op_list or any(op.op not in kinds or op.tensor.device.type != "cpu" for op in p2p_op_list):
        return _hub.originals["batch_isend_irecv"](p2p_op_list)
    specs = []
    for op in p2p_op_list:
        group, peer = _peer(op.group, op.peer, None)
        specs.append((kinds[op.op], op.tensor, peer, group, op.tag))
    return _hub.issue(specs)


_P2P_WRAPPERS = {"isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv}
_P2P_WRAPPERS["batch_isend_irecv"] = _batch_isend_irecv
