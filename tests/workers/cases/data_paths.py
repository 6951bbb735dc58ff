"""Case ``data_paths`` (one per launch): the data-parallel shardings' device paths, pure torch (no Lightning;
tests/test_data_device_paths.py). A small net learns a token mapping; each rank
trains on its slice of the same global batch with SGD (momentum). Recorded on every rank:

- ``hsdp_offload`` (world/2 ranks per shard group, 2 replicas): HSDP ZeRO-2 with offload while
  every group pretends to be NCCL's (no backend for host tensors): a collective handed one of offload's host buffers
  raises, as NCCL does. The largest parameter difference against the same run without offload and against one
  process on the global batch; how many collectives the guard saw, and how many of them were on the replica group;
  HSDP ZeRO-1 against one process.
- ``pieces_zero<s>``: ZeRO-1/2 overlapped, each bucket's pieces per owner (gloo's path), grouped (NCCL's: one
  ``reduce_scatter`` per bucket; the gathers per owner, gloo refusing an uneven ``all_gather``), and one bucket
  split evenly (``reduce_scatter_single`` / ``all_gather_single``), and (stage 2) per owner with offload: parameters
  against the per-owner run, and the collectives each path called.
- ``replicate``: ZeRO-0's all-reduce in 1 KB buckets against one bucket: the largest difference, the largest bucket.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.parallel.data import replicate
from lightning_parallel.parallel.data.flat_overlap import PieceCollectives, even
from lightning_parallel.parallel.data.flat_zero import FlatZero

from .powersgd import VOCAB, Net

PROCESS_GROUP = True
GLOBAL_BATCH, STEPS = 16, 6  # the net and its token mapping: cases/powersgd.py's
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_single",
    "all_gather_single",
    "reduce_scatter",
    "all_gather",
    "reduce",
    "broadcast",
)
PATHS = {  # label: (collectives, bucket MB: None = one bucket over the whole buffer)
    "per_owner": (PieceCollectives(False, False), 0.004),
    "grouped": (PieceCollectives(True, False), 0.004),
    "even": (PieceCollectives(True, True), 1000.0),
}


def fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)


def loss_of(net: Net, step: int, whole: bool = False) -> Tensor:
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(step))
    y = (7 * x + 3) % VOCAB
    if not whole:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        x, y = x[mine], y[mine]
    return nn.functional.cross_entropy(net(x), y)


def params_of(net: Net) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _tensors(values: object) -> Iterator[Tensor]:
    for value in values:  # type: ignore[attr-defined]
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


@contextmanager
def watched(calls: Counter, host: set[int] | None = None, tracked: object = None) -> Iterator[None]:
    """Count every collective by name (and by ``"<name>@tracked"`` on ``tracked``, default the world). With
    ``host``: every group pretends to be device-only (``_compat.group_device_types`` says ``cuda``, as NCCL's groups
    do), and a collective handed a tensor on one of ``host``'s storages raises NCCL's error."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    device_types = _compat.group_device_types
    if host is not None:
        _compat.group_device_types = lambda group=None: ["cuda"]

    def guarded(name: str, fn):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN202
            group = kwargs.get("group")
            calls[name] += 1
            if group is (tracked or dist.group.WORLD) or (tracked is None and group is None):
                calls[f"{name}@tracked"] += 1
            on_host = [t for t in _tensors((*args, *kwargs.values())) if t.untyped_storage().data_ptr() in (host or ())]
            if on_host and "cpu" not in _compat.group_device_types(group):
                raise RuntimeError(f"No backend type associated with device type cpu ({name} on a host buffer)")
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, guarded(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        _compat.group_device_types = device_types


def reference() -> dict[str, Tensor]:
    net, optimizer = fresh()
    for step in range(STEPS):
        loss_of(net, step, whole=True).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(net)


def hsdp(groups: tuple, offload: bool, calls: Counter, stage: int = 2) -> dict[str, Tensor]:
    shard, replicas = groups
    net, optimizer = fresh()
    flat = FlatZero(optimizer, shard, stage, offload=offload, replicate_group=replicas)
    host = set()
    for fg in flat.flat_groups:
        assert (fg.host is not None) == offload and (fg.shard.grad is None)
        if fg.host is not None:
            assert fg.shard is fg.host.param and not fg.host.pinned  # no accelerator here: nothing pinned
            host |= {fg.host.param.untyped_storage().data_ptr(), fg.host.grad.untyped_storage().data_ptr()}
    with watched(calls, host if offload else None, replicas):
        for step in range(STEPS):
            loss_of(net, step).backward()
            flat.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad()
    return params_of(net)


def pieces(stage: int, label: str, calls: Counter) -> dict[str, Tensor]:
    collectives, bucket_mb = PATHS[label.removesuffix("_offload")]
    net, optimizer = fresh()
    offload = label.endswith("_offload")
    flat = FlatZero(optimizer, dist.group.WORLD, stage, offload=offload, overlap_bucket_mb=bucket_mb)
    assert all((fg.host is not None) == offload for fg in flat.flat_groups)
    for buckets in flat._overlap.values():
        buckets.collectives = collectives
        if label == "even":
            assert all(even(buckets.pieces(i), dist.get_world_size()) for i in range(len(buckets.ranges)))
        else:
            assert len(buckets.ranges) > 2, buckets.ranges
    with watched(calls):
        for step in range(STEPS):
            flat.arm()
            loss_of(net, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    return params_of(net)


def replicated(bucket_mb: float, sizes: list[int]) -> dict[str, Tensor]:
    net, _ = fresh()
    loss_of(net, 0).backward()
    bucket = replicate._all_reduce_bucket

    def measured(grads, *args):  # noqa: ANN001, ANN202
        sizes.append(sum(g.numel() for g in grads))
        return bucket(grads, *args)

    replicate._all_reduce_bucket = measured
    try:
        replicate.all_reduce_gradients(list(net.parameters()), dist.group.WORLD, bucket_mb=bucket_mb)
    finally:
        replicate._all_reduce_bucket = bucket
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def run_case(case: dict, ctx) -> dict:
    """Every result on this rank (no case keys)."""
    world, rank = ctx.world, ctx.rank
    results: dict = {}
    want = reference()
    size = world // 2  # 2 replicas of world/2 shards; every rank builds every group
    shards = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(2)]
    replicas = [dist.new_group([i, i + size]) for i in range(size)]
    groups = (shards[rank // size], replicas[rank % size])
    guarded = Counter()
    offloaded = hsdp(groups, True, guarded)
    results["hsdp_offload"] = {
        "vs_device": max_diff(offloaded, hsdp(groups, False, Counter())),
        "vs_reference": max_diff(offloaded, want),
        "calls": dict(guarded),
        "zero1_vs_reference": max_diff(hsdp(groups, False, Counter(), stage=1), want),
    }
    for stage in (1, 2):
        runs, calls = {}, {}
        for label in [*PATHS, *(["per_owner_offload"] if stage == 2 else [])]:
            counted = Counter()
            runs[label] = pieces(stage, label, counted)
            calls[label] = dict(counted)
        results[f"pieces_zero{stage}"] = {
            "vs_per_owner": {label: max_diff(run, runs["per_owner"]) for label, run in runs.items()},
            "vs_reference": max_diff(runs["per_owner"], want),
            "calls": calls,
        }
    small, whole = [], []
    results["replicate"] = {
        "diff": max_diff(replicated(0.001, small), replicated(1000.0, whole)),
        "largest_bucket": max(small),
        "buckets": len(small),
        "whole": whole,
    }
    return results
