"""HF MoE with ``output_router_logits`` under pp: the stages' exchange of router sums in an order NCCL runs.

hf/moe_pipeline.py sends the earlier stages' sums to the last stage and its totals back on one process group per
direction. The old exchange (both directions on one group, kept behind ``_ONE_GROUP``) crosses under 1F1B's
warm-up: stage 0 sends the sums of microbatch 1 before it receives the totals of microbatch 0 while the last stage
sends those totals before it receives the sums of microbatch 1. gloo buffered the sends and passed it; strict mode
(LP_STRICT_COLLECTIVES, on in every harness launch) keeps NCCL's order: the old exchange fails, naming the ranks
and operations, and the new one passes with the parity of tests/test_hf_moe_parity.py's pp runs.
"""

from __future__ import annotations

import os

import pytest
from parity import assert_same_losses, assert_same_params
from test_hf_moe_parity import moe_launch, reference

# world 2, pp=2, two microbatches per step: 1F1B's warm-up and GPipe give stage 0 both forwards before the first
# backward; GPipe in make test-full
SCHEDULES = ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)]

pytestmark = pytest.mark.skipif(
    os.environ.get("LP_STRICT_COLLECTIVES", "1") == "0",
    reason="needs strict mode (run without --no-strict-collectives)",
)


def run_of(schedule: str) -> tuple:
    return (2, f"hybrid3d:pp=2,microbatches=2,pp_schedule={schedule}", "mixtral", 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_exchange_on_two_groups_keeps_parity_under_strict_mode(schedule, tmp_path_factory):
    label = f"mixtral pp2 {schedule}"
    runs = moe_launch(tmp_path_factory, {label: run_of(schedule)}, f"moe_order_{schedule}")
    want_losses, want_params = reference("mixtral", label, microbatches=2)
    assert_same_losses(runs[label].losses("train"), want_losses, label)
    assert_same_params(runs[label].params("train"), want_params, label)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_old_exchange_on_one_group_fails_under_strict_mode(schedule, tmp_path_factory):
    label = f"mixtral pp2 {schedule} one group"
    runs = moe_launch(tmp_path_factory, {label: run_of(schedule)}, f"moe_order_old_{schedule}")
    for case in runs.runs[label][2]:
        case.update(moe_one_group=True, steps=2)
    with pytest.raises(AssertionError, match="run.py at world 2 failed"):
        runs[label]
    logs = sorted(tmp_path_factory.getbasetemp().glob(f"batch_w2moe_order_old_{schedule}*/rank*.log"))
    text = "\n".join(log.read_text() for log in logs)
    assert "ranks 0 and 1 of group" in text or "ranks 1 and 0 of group" in text, text[-3000:]
    assert "wait for each other" in text, text[-3000:]
    # each side's pending operations: stage 0 sends microbatch 1's sums before receiving microbatch 0's totals, the
    # last stage sends microbatch 0's totals before receiving microbatch 1's sums
    assert "rank 0 pending with rank 1: send #2 to rank 1 (9 torch.float32" in text, text[-3000:]
    assert "rank 1 pending with rank 0: send #1 to rank 0 (5 torch.float32" in text, text[-3000:]
