"""Case ``context``: context-parallel attention (ring and Ulysses) against plain causal attention
(tests/test_context_parallel.py, test_ring_overlap.py, test_ring_precision.py). Every rank builds the same q, k, v
and output gradient for the whole sequence (drawn in fp64, cast to the case's dtype); the reference is
``scaled_dot_product_attention(is_causal=True)`` on all of it in the same dtype, the context-parallel attention sees
this rank's two chunks (``shard_sequence``). Recorded: the largest absolute difference of this rank's output rows and
of its q, k, v gradients, and the bytes the ring sent.

Case keys: name, mode ("ring" or "ulysses"), batch, heads, seq_len, head_dim, dtype ("float32", "float64",
"bfloat16"); ring only: kernel (a block kernel name, default by device), grad_dtype (the accumulators' wire dtype),
trace (record the order of the ring's exchanges and block computations: ``events``), truth (also the errors of the
ring and of the one-process reference against fp64, relative to the largest fp64 value: ``truth``).
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.parallel.context import ring
from lightning_parallel.parallel.context.ring import ring_attention
from lightning_parallel.parallel.context.split import shard_sequence
from lightning_parallel.parallel.context.ulysses import ulysses_attention

PROCESS_GROUP = True


def attention(case: dict):
    if case["mode"] == "ulysses":
        return ulysses_attention
    options = {"kernel": case.get("kernel")}
    if "grad_dtype" in case:
        options["grad_dtype"] = getattr(torch, case["grad_dtype"])
    return lambda q, k, v, group: ring_attention(q, k, v, group, **options)


def whole(tensors, dtype, dout):
    """Output and q, k, v gradients of one process's causal attention over the whole sequence, in ``dtype``."""
    leaves = [t.to(dtype, copy=True).requires_grad_(True) for t in tensors]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def traced(events: list, stack: ExitStack) -> None:
    """Record, in order, every ring exchange posted and waited for and every block computed, as
    [what, direction, kind, n]: ("post" | "wait", direction, "kv" | "grad", n) and ("block", direction, "block", n).
    Blocks and grad hops count from 0 in each direction, kv hops from 1 (kv hop h brings the keys of block h)."""
    counts: Counter = Counter()

    def numbered(direction: str, kind: str) -> int:
        counts[direction, kind] += 1
        return counts[direction, kind] - (kind != "kv")

    class TracedHop(ring.RingHop):
        def __init__(self, tensors, group, direction, tag):
            super().__init__(tensors, group, direction, tag)
            kind = "kv" if tag == ring.KV_TAG else "grad"
            self.event = [direction, kind, numbered(direction, kind)]
            events.append(["post", *self.event])

        def wait(self):
            received = super().wait()
            events.append(["wait", *self.event])
            return received

    def block(direction: str, kernel):
        def run(*args, **kwargs):
            events.append(["block", direction, "block", numbered(direction, "block")])
            return kernel(*args, **kwargs)

        return run

    stack.enter_context(mock.patch.object(ring, "RingHop", TracedHop))
    stack.enter_context(mock.patch.object(ring, "block_attention", block("forward", ring.block_attention)))
    backward = block("backward", ring.block_attention_backward)
    stack.enter_context(mock.patch.object(ring, "block_attention_backward", backward))


def run_case(case: dict, ctx) -> dict:
    rank, world = ctx.rank, ctx.world
    dtype = getattr(torch, case.get("dtype", "float32"))
    shape = (case.get("batch", 2), case.get("heads", 4), case["seq_len"], case.get("head_dim", 8))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    want = whole((q, k, v), dtype, dout)
    mine = [shard_sequence(t, world, rank, dim=2).to(dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
    sent_before, events = dict(ring.SENT), []
    with ExitStack() as stack:
        if case.get("trace"):
            traced(events, stack)
        got = attention(case)(*mine, dist.group.WORLD)
        got.backward(shard_sequence(dout, world, rank, dim=2).to(dtype))
    got = [got.detach()] + [m.grad for m in mine]

    def diff(a, b):
        return (a.double() - shard_sequence(b.double(), world, rank, dim=2)).abs().max().item()

    result = {
        "name": case["name"],
        "mode": case["mode"],
        "out": diff(got[0], want[0]),
        "grads": [diff(m, w) for m, w in zip(got[1:], want[1:])],
        "sent": {key: ring.SENT[key] - sent_before[key] for key in ring.SENT},
        "kv_bytes": 2 * mine[1].numel() * mine[1].element_size(),
        "events": events,
    }
    if case.get("truth"):
        truth = whole((q, k, v), torch.float64, dout)
        scale = [t.abs().max().item() for t in truth]
        result["truth"] = {
            "ring": [diff(a, t) / s for a, t, s in zip(got, truth, scale)],
            "one_process": [diff(shard_sequence(a, world, rank, dim=2), t) / s for a, t, s in zip(want, truth, scale)],
        }
    return result
