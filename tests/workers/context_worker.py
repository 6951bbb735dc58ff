"""Worker: context-parallel attention (ring and Ulysses) against plain causal attention; writes rank<N>.json.

Run by tests/harness.py on N processes (torchrun's environment). Every rank builds the same q, k, v and output
gradient for the whole sequence; the reference is ``scaled_dot_product_attention(is_causal=True)`` on all of it,
the context-parallel attention sees this rank's two chunks (``shard_sequence``). Recorded: the largest absolute
difference of this rank's output rows and of its q, k, v gradients, and the bytes the ring sent.

Case keys: name, mode ("ring" or "ulysses"), batch, heads, seq_len, head_dim, dtype ("float32", "float64").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.parallel.context import ring
from lightning_parallel.parallel.context.ring import ring_attention
from lightning_parallel.parallel.context.split import shard_sequence
from lightning_parallel.parallel.context.ulysses import ulysses_attention
from lightning_parallel.parallel.shutdown import release_process_groups

ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}


def run_case(case: dict, rank: int, world: int) -> dict:
    dtype = getattr(torch, case.get("dtype", "float32"))
    shape = (case.get("batch", 2), case.get("heads", 4), case["seq_len"], case.get("head_dim", 8))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(4))
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=True)
    want.backward(dout)
    mine = [shard_sequence(t, world, rank, dim=2).requires_grad_(True) for t in (q, k, v)]
    sent_before = dict(ring.SENT)
    got = ATTENTION[case["mode"]](*mine, dist.group.WORLD)
    got.backward(shard_sequence(dout, world, rank, dim=2))

    def diff(a, b):
        return (a.detach() - shard_sequence(b.detach(), world, rank, dim=2)).abs().max().item()

    return {
        "name": case["name"],
        "mode": case["mode"],
        "out": diff(got, want),
        "grads": [diff(m.grad, w.grad) for m, w in zip(mine, whole)],
        "sent": {key: ring.SENT[key] - sent_before[key] for key in ring.SENT},
        "kv_bytes": 2 * mine[1].numel() * mine[1].element_size(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of cases")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [run_case(case, rank, world) for case in json.loads(args.cases)]
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))
    release_process_groups()


if __name__ == "__main__":
    main()
