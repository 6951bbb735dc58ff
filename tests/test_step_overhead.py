"""Issue 32: a step does no collective it can do without. One launch at world 2 counts the collectives of one
steady step of the tiny GPT per strategy (tests/workers/cases/collectives.py), by kind and group size, and
the barriers; Lightning's ddp is counted beside them. What a step needs: the gradients' reduction (one bucket at
ZeRO 0; one reduce-scatter or all-reduce and one all-gather per flat group at ZeRO 1-2) and the logged loss's
all-reduce over dp; no barrier, nothing over a group of one, the norm's all-reduce only when clipping. Parity of
the same paths with one process: tests/test_zero_parity.py, tests/test_hybrid3d_parity.py."""

from __future__ import annotations

import json

import pytest
from harness import run_worker

SPECS = ["ddp", "hybrid3d", "hybrid3d+clip", "zero1", "zero2", "hybrid3d:tp=2"]


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
    assert counted["zero1"]["counts"] == {"all_reduce@2": groups + 1, "all_gather@2": groups}
    assert counted["zero2"]["counts"] == {"reduce_scatter@2": groups, "all_gather@2": groups, "all_reduce@2": 1}
    ours = sum(counted["hybrid3d"]["counts"].values()) + counted["hybrid3d"]["barriers"]
    assert ours < sum(counted["ddp"]["counts"].values()) + counted["ddp"]["barriers"]


def test_tensor_parallel_step_reduces_no_loss_over_a_dp_of_one(counted):
    counts = counted["hybrid3d:tp=2"]["counts"]
    assert set(counts) == {"all_reduce@2"}, counts  # tp's own all-reduces only
