"""Ring attention overlaps its exchanges with its block computations (tests/workers/cases/context.py, gloo).

Every exchange of the ring and every block computed is recorded in order on each rank (the worker wraps
``ring.RingHop`` and the block kernels). Forward: the keys and values of block h are posted before block h - 1 is
computed and waited for only after it. Backward: the same for the keys and values, and each gradient accumulator is
posted right after its block and waited for only after the next block has been computed (the last one: at the end).
A ring that waited for an exchange before computing the block it overlaps fails here. At cp=1 nothing is exchanged.
"""

from __future__ import annotations

import json

import pytest
from harness import run_worker

from lightning_parallel.parallel.context import ring_bytes

CASE = {"name": "trace", "mode": "ring", "seq_len": 24, "trace": True}


def _position(events: list, what: str, direction: str, kind: str, n: int) -> int:
    matches = [i for i, e in enumerate(events) if e == [what, direction, kind, n]]
    assert len(matches) == 1, f"{what} {direction} {kind} {n}: found {len(matches)} times in {events}"
    return matches[0]


def check_overlap(events: list, cp: int, label: str) -> None:
    for direction in ("forward", "backward"):

        def at(what: str, kind: str, n: int, direction=direction) -> int:
            return _position(events, what, direction, kind, n)

        blocks = [at("block", "block", b) for b in range(cp)]
        assert blocks == sorted(blocks), f"{label} {direction}: blocks out of order"
        for h in range(1, cp):  # kv hop h brings block h's keys: in flight while block h - 1 is computed
            posted, waited = at("post", "kv", h), at("wait", "kv", h)
            assert posted < blocks[h - 1] < waited < blocks[h], f"{label} {direction} kv hop {h}: {events}"
        kinds = {e[2] for e in events if e[1] == direction and e[0] != "block"}
        assert kinds == ({"kv", "grad"} if direction == "backward" else {"kv"}), (label, direction, kinds)
    blocks = [_position(events, "block", "backward", "block", b) for b in range(cp)]
    for g in range(cp):  # accumulator g leaves after block g, is waited for after block g + 1 (the last: at the end)
        posted, waited = (_position(events, what, "backward", "grad", g) for what in ("post", "wait"))
        after = blocks[g + 1] if g + 1 < cp else posted
        assert blocks[g] < posted <= after < waited, f"{label} accumulator hop {g}: {events}"


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_ring_exchanges_are_in_flight_while_blocks_compute(world, tmp_path):
    ranks = run_worker("context", world, ["--cases", json.dumps([CASE])], tmp_path)
    for rank, (got,) in enumerate(ranks):
        label = f"cp={world} rank {rank}"
        assert got["out"] <= 2e-6 and max(got["grads"]) <= 2e-6, f"{label}: {got}"
        assert got["sent"] == ring_bytes(got["kv_bytes"], world), f"{label}: ring bytes {got['sent']}"
        events = got["events"]
        if world == 1:
            assert [e[0] for e in events] == ["block", "block"], f"{label}: {events}"
            continue
        check_overlap(events, world, label)
        # cp blocks each way; cp - 1 kv hops each way, cp accumulator hops: each posted and waited for once
        assert len(events) == 2 * world + 2 * 2 * (world - 1) + 2 * world, f"{label}: {events}"


def test_the_overlap_check_fails_on_a_ring_that_waits_before_computing():
    """The check itself: the old order (exchange, wait, then compute) is rejected."""
    waits_first = [["block", "forward", "block", 0]]
    for h in (1, 2):
        waits_first += [["post", "forward", "kv", h], ["wait", "forward", "kv", h], ["block", "forward", "block", h]]
    with pytest.raises(AssertionError, match="forward kv hop 1"):
        check_overlap(waits_first, 3, "waits first")


def test_the_overlap_check_fails_on_an_accumulator_waited_for_before_the_next_block():
    forward = [["post", "forward", "kv", 1], ["block", "forward", "block", 0]]
    forward += [["wait", "forward", "kv", 1], ["block", "forward", "block", 1]]
    backward = [("post", "kv", 1), ("block", "block", 0), ("post", "grad", 0), ("wait", "kv", 1)]
    backward += [("wait", "grad", 0), ("block", "block", 1), ("post", "grad", 1), ("wait", "grad", 1)]
    events = forward + [[what, "backward", kind, n] for what, kind, n in backward]
    with pytest.raises(AssertionError, match="accumulator hop 0"):
        check_overlap(events, 2, "accumulator waited first")
    good = backward[:4] + [backward[5], backward[4]] + backward[6:]  # block 1 before the accumulator's wait
    check_overlap(forward + [[what, "backward", kind, n] for what, kind, n in good], 2, "good")
