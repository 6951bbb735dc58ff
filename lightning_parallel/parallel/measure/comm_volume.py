"""Bytes moved by this rank's collectives and point-to-point ops, counted at the dispatcher. Pure torch.

Every c10d operation goes through torch's dispatcher as a ``c10d::*`` op (``dist.all_reduce``, DDP's reducer,
FSDP2's all-gather and reduce-scatter, ``dist.send``/``recv`` of the pipeline) or a ``_c10d_functional::*`` op
(DTensor redistribution: tensor parallelism), so one ``TorchDispatchMode`` sees them all.
``torch.distributed.tensor.debug.CommDebugMode`` does the same but counts calls, not bytes, and leaves out
send and recv; the profiler's ``record_param_comms`` events are not emitted by every backend.

Convention, per op and rank (``w`` = the op's group size, ``n`` = the op's payload):

=================  ======================================  ==========================
kind               payload ``n``                           sent (``sent_bytes``)
=================  ======================================  ==========================
all_reduce         bytes of the tensor reduced             ``2 n (w-1)/w`` (ring)
all_gather         bytes of the whole gathered output      ``n (w-1)/w``
reduce_scatter     bytes of the whole input                ``n (w-1)/w``
all_to_all         bytes of the input                      ``n (w-1)/w``
gather, scatter    bytes of the whole gathered/scattered   ``n (w-1)/w``
broadcast, reduce  bytes of the tensor                     ``n`` (pipelined ring)
send               bytes sent                              ``n``
recv               bytes received                          0
=================  ======================================  ==========================

These are the bus-bandwidth factors of NCCL's own tests: what a ring (bandwidth-optimal) algorithm sends per
rank, whatever the backend actually does. With them, DP's gradient all-reduce of P bytes is ``2P(w-1)/w``,
ZeRO-3's all-gather (forward) + all-gather (backward) + reduce-scatter is ``3P(w-1)/w``, 1.5x that.
A group of one sends nothing.

Each event also records its process group's name; given the mesh's names for them
(:meth:`~lightning_parallel.parallel.mesh.ParallelMesh.group_axes`), the bytes split by mesh axis (``by_axis``): what
crosses nodes is what the outer axes (``pp``, HSDP's replicas ``dpr``, an unsplit ``dp``) send.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel._compat import TorchDispatchMode, group_name_of, group_size_of, tree_leaves
from lightning_parallel.parallel import strict

# op name -> (kind, which argument holds the payload: "in" the input tensors, "out" the output tensors)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 0),
    "scatter_": ("scatter", 1),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "broadcast": lambda w: 1.0, "reduce": lambda w: 1.0}
_FACTOR |= {"send": lambda w: 1.0, "recv": lambda w: 0.0}
_DEFAULT_FACTOR = lambda w: (w - 1) / w  # noqa: E731  (all_gather, reduce_scatter, gather, scatter, all_to_all)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, Tensor))


def sent_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for an op of ``payload`` bytes over ``group_size`` ranks (see the module's table)."""
    if group_size <= 1:
        return 0.0
    return payload * _FACTOR.get(kind, _DEFAULT_FACTOR)(group_size)


@dataclass
class CommEvent:
    """One collective or point-to-point op as this rank issued it."""

    kind: str
    payload_bytes: int
    group_size: int
    dtype: str
    group: str = ""  # the process group's name: which mesh axes it spans (ParallelMesh.group_axes)

    @property
    def sent_bytes(self) -> float:
        return sent_bytes(self.kind, self.payload_bytes, self.group_size)


def _functional_group_size(name: str, args: tuple) -> int:
    if name.startswith(("all_gather", "reduce_scatter")):
        return int(args[1] if name.startswith("all_gather") else args[2])
    return group_size_of(args[-1])


def _event(func: Any, args: tuple, kwargs: dict) -> CommEvent | None:
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace == "c10d" and name in _C10D:
        kind, index = _C10D[name]
        group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
        payload_arg = args[index]
        size, group_name = group.size(), group.group_name
    elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
        kind, payload_arg = _FUNCTIONAL[name], args[0]
        size, group_name = _functional_group_size(name, args), group_name_of(args[-1])
        if kind == "all_gather":  # the functional op's argument is this rank's shard
            return _make(kind, _nbytes(payload_arg) * size, size, payload_arg, group_name)
    else:
        return None
    return _make(kind, _nbytes(payload_arg), size, payload_arg, group_name)


def _make(kind: str, payload: int, size: int, tensors: Any, group: str = "") -> CommEvent:
    first = next((t for t in tree_leaves(tensors) if isinstance(t, Tensor)), None)
    return CommEvent(kind, payload, size, str(first.dtype).replace("torch.", "") if first is not None else "", group)


class _P2PSink(list):
    """strict mode's recording list that hands each send / recv to ``note`` as it is issued."""

    def __init__(self, note: Any) -> None:
        super().__init__()
        self.note = note

    def append(self, entry: Any) -> None:
        if entry.op in ("send", "recv"):
            self.note(entry)


class CommCounter(TorchDispatchMode):
    """Counts the bytes this rank's collectives and send/recv move while active (a context manager).

    Sees ``torch.distributed`` calls, DDP's gradient buckets, FSDP2, ZeRO's flat buffers, DTensor tensor
    parallelism and pipeline P2P; what it reports follows the module's convention. Counting only notes the
    op's arguments: the op itself runs unchanged.

    Attributes:
        events: every op, in issue order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[CommEvent] = []
        self._strict: Any = None

    def __enter__(self) -> CommCounter:
        # strict mode runs point-to-point ops on executor threads, out of this thread's dispatch modes: its trace
        # notes each as it is issued here, in order among the collectives (tests/test_observability.py)
        if strict.enabled():
            self._strict = strict.recording(_P2PSink(self._strict_p2p))
            self._strict.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        if self._strict is not None:
            self._strict.__exit__(None, None, None)
            self._strict = None
        return out

    def _strict_p2p(self, entry: Any) -> None:
        """A point-to-point op strict mode issued on its executor (a subclass notes more of it)."""
        self.events.append(
            CommEvent(entry.op, entry.bytes, len(strict.group_ranks(entry.group)), entry.dtype, entry.group)
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into the collectives it needs, which come back here
        if func.namespace in ("c10d", "_c10d_functional"):
            event = _event(func, args, kwargs)
            if event is not None:
                self.events.append(event)
        return func(*args, **kwargs)

    def by_kind(self, axes_of: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
        """``{kind: {"calls", "payload_bytes", "sent_bytes"}}`` over all events; given ``axes_of`` (process group
        name -> the mesh axes it spans, ``ParallelMesh.group_axes()``), each row also splits its sent bytes by
        axis: ``"by_axis": {"dpr": ..., "dp": ...}`` (a group the mesh did not make counts as ``"other"``)."""
        out: dict[str, dict[str, Any]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0})
        for e in self.events:
            row = out[e.kind]
            row["calls"] += 1
            row["payload_bytes"] += e.payload_bytes
            row["sent_bytes"] += e.sent_bytes
            if axes_of is not None:
                by_axis = row.setdefault("by_axis", {})
                axis = axes_of.get(e.group, "other")
                by_axis[axis] = by_axis.get(axis, 0.0) + e.sent_bytes
        return dict(out)

    def by_axis(self, axes_of: Mapping[str, str]) -> dict[str, dict[str, float]]:
        """``{axes: {"calls", "payload_bytes", "sent_bytes"}}``: the events grouped by the mesh axes their group
        spans (``axes_of`` as in :meth:`by_kind`)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0})
        for e in self.events:
            row = out[axes_of.get(e.group, "other")]
            row["calls"] += 1
            row["payload_bytes"] += e.payload_bytes
            row["sent_bytes"] += e.sent_bytes
        return dict(out)

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sent in all, under the module's convention."""
        return sum(e.sent_bytes for e in self.events)
