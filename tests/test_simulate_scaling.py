"""A pipeline step of many microbatches simulated from a shorter one (lightning_parallel/simulate/scaling.py) against
the same step simulated in full: every collective's count, the bytes sent and the FLOPs equal; model states equal;
activations equal but for the last stage's losses (8 bytes a microbatch); the step's peak within 0.5%."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_parallel.models import GPTConfig
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.simulate import simulate
from lightning_parallel.simulate.scaling import reduced_microbatches

CASES = {
    # label -> (world, layout, microbatches, layers)
    "pp2_1f1b": (2, "pp=2,pp_schedule=1f1b", 6, 2),
    "pp4_interleaved": (4, "pp=4,pp_schedule=interleaved_1f1b", 12, 8),
    "pp2_tp2_zero3_interleaved": (
        8,
        "pp=2,tp=2,zero_stage=3,sequence_parallel=true,reshard_after_forward=false,"
        "activation_checkpointing=full,pp_schedule=interleaved_1f1b",
        6,
        4,
    ),
}


def _ops(rank) -> Counter:
    out: Counter = Counter()
    for c in rank.collectives:
        out[(c.op, c.axes, c.dtype, c.shape, c.ranks, c.peer, c.payload_bytes)] += c.count
    return out


def _check(label: str, steps: int) -> None:
    """``steps=1``: the first step, the warm-up vote's messages among the ops; 2: the second, without them."""
    world, layout, microbatches, layers = CASES[label]
    model = GPTConfig(vocab_size=64, seq_len=16, n_layer=layers, n_head=4, d_model=32)
    run = {"precision": "32-true", "steps": steps}
    scaled = simulate(model, world, f"{layout},microbatches={microbatches}", **run)
    full = simulate(model, world, f"{layout},microbatches={microbatches}", full_schedule=True, **run)
    pp = scaled.config.pp
    assert not scaled.mismatches and not full.mismatches
    for s, f in zip(scaled.ranks, full.ranks, strict=True):
        assert (s.microbatches_run, f.microbatches_run) == (2 * pp, None)
        assert s.microbatches_agree
        assert len(s.trace) < len(f.trace)  # the shorter step was run
        assert _ops(s) == _ops(f), s.rank
        sent = [sum(c.sent_bytes * c.count for c in r.collectives) for r in (s, f)]
        assert sent[0] == sent[1] and s.flops == f.flops and s.model_state_bytes == f.model_state_bytes
        # the last stage keeps each microbatch's loss (and its scaled copy) to the step's end: 8 bytes a microbatch
        assert 0 <= f.activation_bytes - s.activation_bytes <= 8 * (microbatches - 2 * pp), s.rank
        assert abs(s.peak_bytes - f.peak_bytes) <= 0.005 * f.peak_bytes, (s.rank, s.peak_bytes, f.peak_bytes)
    assert [t.total for t in scaled.times] == pytest.approx([t.total for t in full.times], rel=1e-9)


def test_scaled_pipeline_step_equals_the_full_one():
    _check("pp2_1f1b", steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["pp4_interleaved", "pp2_tp2_zero3_interleaved"])
def test_scaled_pipeline_steps_equal_the_full_ones(label):
    _check(label, steps=2)


def test_which_steps_are_shortened():
    def reduced(**kw) -> int | None:
        return reduced_microbatches(ParallelConfig(**kw))

    assert reduced(pp=4, pp_schedule="1f1b", microbatches=16) == 8
    assert reduced(pp=4, pp_schedule="interleaved_1f1b", microbatches=56) == 8
    assert reduced(pp=4, pp_schedule="1f1b", microbatches=8) is None  # already 2 * pp
    assert reduced(pp=4, pp_schedule="1f1b", microbatches=18) is None  # not a multiple of pp
    assert reduced(pp=4, pp_schedule="gpipe", microbatches=16) is None  # every microbatch in flight
    assert reduced(tp=2) is None
