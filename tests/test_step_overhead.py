"""Issue 32: a step does no collective it can do without. One launch at world 2 counts the collectives of one
steady step of the tiny GPT per strategy (tests/workers/cases/collectives.py), by kind and group size, and
the barriers; Lightning's ddp is counted beside them. What a step needs: the gradients' reduction (one bucket at
ZeRO 0; one reduce-scatter or all-reduce and one all-gather at ZeRO 1-2) and the logged loss's
all-reduce over dp; no barrier, nothing over a group of one, the norm's all-reduce only when clipping. ZeRO 1-2
issue one collective of each kind for the GPT's two parameter groups, not one per group. Parity of
the same paths with one process: tests/test_zero_parity.py, tests/test_hybrid3d_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_worker

from lightning_parallel.parallel import clip
from lightning_parallel.parallel.data.flat_group import FlatGroup, comm_sets, rank_major

SPECS = ["ddp", "hybrid3d", "hybrid3d+clip", "zero1", "zero2", "zero2+clip", "hybrid3d:tp=2"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("collective_counts")
    ranks = run_worker("collectives", 2, ["--opts", json.dumps({"specs": SPECS})], out, timeout=300)
    assert ranks[0] == ranks[1]  # every rank issues the same collectives
    return ranks[0]


def test_a_step_has_no_barrier_and_no_group_of_one(counted):
    for spec, c in counted.items():
        if spec != "ddp":  # Lightning's reduce of a logged value puts a barrier before its all-reduce
            assert c["barriers"] == 0, (spec, c)
        assert not any(key.endswith("@1") for key in c["counts"]), (spec, c)
    assert counted["ddp"]["barriers"] == 1  # what ours leave out (the count would show one if ours had it)


def test_data_parallel_steps_issue_only_what_they_need(counted):
    groups = counted["zero1"]["groups"]
    assert groups == 2  # the GPT's decayed and undecayed parameters: two flat buffers at ZeRO 1-2
    assert counted["hybrid3d"]["counts"] == {"all_reduce@2": 2}  # one gradient bucket, the logged loss
    assert counted["hybrid3d+clip"]["counts"] == {"all_reduce@2": 3}  # the norm's: only when clipping
    # one collective of each kind for both groups, not one per group (flat_group.comm_sets)
    assert counted["zero1"]["counts"] == {"all_reduce@2": 2, "all_gather@2": 1}  # the gradients, the logged loss
    assert counted["zero2"]["counts"] == {"reduce_scatter@2": 1, "all_gather@2": 1, "all_reduce@2": 1}
    assert counted["zero2+clip"]["counts"] == {"reduce_scatter@2": 1, "all_gather@2": 1, "all_reduce@2": 2}
    ours = sum(counted["hybrid3d"]["counts"].values()) + counted["hybrid3d"]["barriers"]
    assert ours < sum(counted["ddp"]["counts"].values()) + counted["ddp"]["barriers"]


def test_tensor_parallel_step_reduces_no_loss_over_a_dp_of_one(counted):
    counts = counted["hybrid3d:tp=2"]["counts"]
    assert set(counts) == {"all_reduce@2"}, counts  # tp's own all-reduces only


def _flat_group(numel: int, world: int = 2, dtype=torch.float32, group=None) -> FlatGroup:
    shard = -(-numel // world)
    flat = torch.arange(shard * world, dtype=dtype)
    return FlatGroup([], [0], shard, flat, None, flat[:shard], group, 0, world)


def test_comm_sets_merge_groups_of_one_kind_up_to_the_limit():
    small, other, big = _flat_group(10), _flat_group(6, dtype=torch.float64), _flat_group(2**20)  # big: 4 MB
    second = _flat_group(4)
    assert comm_sets([small, other, second], None) == [[small, second], [other]]  # one set per dtype, in order
    assert comm_sets([small, big, second], 4.0) == [[small], [big], [second]]  # 4 MB + 40 bytes > 4 MB
    assert comm_sets([small, big, second], 5.0) == [[small, big, second]]


def test_rank_major_puts_each_ranks_chunks_together():
    a, b = torch.arange(4.0), torch.arange(10.0, 16.0)  # 2 ranks: chunks of 2 and 3
    assert rank_major([a, b], 2).tolist() == [0, 1, 10, 11, 12, 2, 3, 13, 14, 15]


def test_partial_norms_share_one_collective_per_axis(monkeypatch):
    """Partial norms split over (dp) and (dp, tp): one all-reduce over dp carries both, one over tp the second (not
    three); each reduced only over its own axes. A fake group of 2 ranks holding equal partials doubles a sum."""
    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((group, tensor.numel()))
        tensor.mul_(2)

    monkeypatch.setattr(clip.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(clip.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(clip, "collective_device", lambda group: torch.device("cpu"))
    replicated, split = torch.full((4,), 1.0), torch.full((9,), 2.0)  # |g|^2: 4 and 36
    norm = clip.total_norm([(replicated, ("dp",)), (split, ("dp", "tp"))], {"dp": "dp", "tp": "tp"})
    assert calls == [("dp", 2), ("tp", 1)]
    assert torch.isclose(norm, torch.tensor(4.0 * 2 + 36.0 * 4).sqrt())
