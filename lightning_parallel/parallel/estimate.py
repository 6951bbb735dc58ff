"""Closed-form estimates for a (pp, dp, tp, zero_stage) layout, from a measured per-layer profile. Pure Python.

Everything here is arithmetic on :class:`LayerCost` records (what one pipeline layer holds and does on one tp
rank, measured by :mod:`lightning_parallel.parallel.planner`), so it is unit-tested without any process group:

- model states per rank: parameters, gradients and optimizer states by the ZeRO formulas (Rajbhandari et al.,
  2020), sharded over dp; tp and pp divide them through the layer records (a stage holds its layers' tp shard);
- activations per rank: one microbatch's saved bytes times the microbatches the schedule keeps in flight;
- pipeline bubble, communication bytes per step per rank, and a step time under a simple cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# optimizer states per parameter: AdamW keeps exp_avg and exp_avg_sq, SGD with momentum its momentum buffer
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd_no_momentum": 0}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: use one of {', '.join(PRECISIONS)}.")
    return precision


def element_bytes(precision: str) -> int:
    """Bytes of one parameter, gradient or optimizer-state element: the mixed precisions keep fp32 states
    (autocast casts in the forward), ``bf16-true`` keeps everything in bf16."""
    return 2 if check_precision(precision) == "bf16-true" else 4


def model_state_bytes(num_params: int, dp: int, zero_stage: int, elem: int = 4, states: int = 2) -> int:
    """Parameter, gradient and optimizer-state bytes on one rank holding ``num_params`` (its stage's tp shard).

    Args:
        num_params: parameters this rank's layers hold before ZeRO shards them.
        dp: the data-parallel degree ZeRO shards over.
        zero_stage: 0 (nothing sharded), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
        elem: bytes per element (4 for fp32).
        states: optimizer-state tensors per parameter (2 for Adam).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3.")
    p, g, k = elem * num_params, elem * num_params, elem * states * num_params
    sharded = {0: 0, 1: k, 2: g + k, 3: p + g + k}[zero_stage]
    return p + g + k - sharded + math.ceil(sharded / dp)


def bubble_fraction(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1) (GPipe, 1F1B), 1/v of it for interleaved 1F1B with v
    stages per rank (Narayanan et al., 2021), 0 for zero-bubble (ZB-V's ideal; a lower bound)."""
    if pp == 1:
        return 0.0
    if schedule == "zero_bubble":
        return 0.0
    bubble = (pp - 1) / (microbatches + pp - 1)
    return bubble / virtual_stages if schedule == "interleaved_1f1b" else bubble


def in_flight(schedule: str, pp: int, microbatches: int, pp_rank: int, virtual_stages: int = 1) -> float:
    """Microbatches whose activations pp rank ``pp_rank`` holds at once, in units of one microbatch through
    all of the rank's layers (its peak, just before its first backward).

    GPipe: all m. 1F1B: pp - rank (the warmup forwards plus one). Interleaved 1F1B (torch's schedule):
    (v-1) * (m / rounds) + 2 * (pp-1-rank) warmup forwards plus one, each through one of the rank's v stages,
    so 1/v of its layers. Zero-bubble (ZB-V): taken as 1F1B's first rank, min(m, pp) (what ZB-V is built to
    match, Qi et al., 2024; an estimate, not measured here).
    """
    m = microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - pp_rank))
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // pp)
        warmup = (virtual_stages - 1) * per_round + 2 * (pp - 1 - pp_rank)
        return min(m * virtual_stages, warmup + 1) / virtual_stages
    if schedule == "zero_bubble":
        return float(min(m, pp))
    raise ValueError(f"pp_schedule={schedule!r} is unknown: use one of {', '.join(SCHEDULES)}.")


def all_reduce_bytes(payload: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: 2 * payload * (w-1)/w."""
    return 2 * payload * (world - 1) / world


def dp_comm_bytes(num_params: int, dp: int, zero_stage: int, elem: int = 4) -> float:
    """Gradient synchronization per step: an all-reduce of the rank's gradients, 2P(w-1)/w bytes (ZeRO-2's
    reduce-scatter plus all-gather of the updated slices is the same). 1.5x for ZeRO-3 (parameters gathered
    for forward and again for backward, gradients reduce-scattered) and for this package's ZeRO-1 (gradients
    all-reduced, then the updated slices all-gathered)."""
    volume = all_reduce_bytes(num_params * elem, dp)
    return 1.5 * volume if zero_stage in (1, 3) else volume


@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer on one tp rank, per sample where it scales with the batch.

    Attributes:
        params: parameter key -> elements on this tp rank (tied weights share a key: one copy per stage).
        act_fixed, act_per_sample: bytes the layer's forward leaves for backward (its output included):
            ``act_fixed + act_per_sample * batch``.
        loss_fixed, loss_per_sample: what computing the loss on this layer's output adds once the output itself
            is let go (the last layer only; a log-softmax keeps a logits-sized result: about 0 in fp32).
        in_per_sample, out_per_sample: bytes of the layer's input and output (what pipeline stages exchange).
        flops_per_sample: forward FLOPs on this tp rank.
        tp_payload_per_sample: bytes all-reduced over tp, forward and backward (one all-reduce each).
    """

    params: dict[str, int]
    act_fixed: float = 0.0
    act_per_sample: float = 0.0
    loss_fixed: float = 0.0
    loss_per_sample: float = 0.0
    in_per_sample: float = 0.0
    out_per_sample: float = 0.0
    flops_per_sample: float = 0.0
    tp_payload_per_sample: float = 0.0


@dataclass(frozen=True)
class Settings:
    """What a layout is estimated for besides its degrees.

    Attributes:
        global_batch: samples per optimizer step.
        microbatches: per pipeline step (None: 2 * pp, the strategy's default).
        schedule, virtual_stages: the pipeline schedule and its stages per rank.
        precision: Lightning's precision flag.
        optimizer_states: optimizer-state tensors per parameter (:data:`OPTIMIZER_STATES`).
        device_memory: bytes per device; margin: the fraction to keep free for what is not estimated.
        device_flops, bandwidth: sustained FLOP/s and bytes/s per rank for the step-time model.
    """

    global_batch: int
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    precision: str = "32-true"
    optimizer_states: int = 2
    device_memory: float = 80e9
    margin: float = 0.1
    device_flops: float = 100e12
    bandwidth: float = 50e9


@dataclass
class Estimate:
    """One layout's numbers; ``reason`` says why it is infeasible ("" when it is not). ``zero_stage`` is None
    for a split refused before any estimate (the reason holds for every stage)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int | None
    reason: str = ""
    microbatches: int = 1
    memory_per_rank: list[float] = field(default_factory=list)  # per pp rank: model states + activations
    model_state_per_rank: list[float] = field(default_factory=list)
    activation_per_rank: list[float] = field(default_factory=list)
    bubble: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # dp, tp, pp bytes per step, the busiest rank
    step_time: float = math.inf

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def memory(self) -> float:
        return max(self.memory_per_rank, default=0.0)


def rank_layers(num_layers: int, stages: Sequence[range], stage_ranks: Sequence[int], pp: int) -> list[list[int]]:
    """Layer indices each pp rank holds, from the stage partition and the rank of each stage."""
    held: list[list[int]] = [[] for _ in range(pp)]
    for stage, rank in zip(stages, stage_ranks):
        held[rank] += list(stage)
    assert sorted(i for h in held for i in h) == list(range(num_layers))
    return held


def estimate_layout(
    costs: Sequence[LayerCost],
    stages: Sequence[range],
    stage_ranks: Sequence[int],
    dims: tuple[int, int, int],
    zero_stage: int,
    s: Settings,
) -> Estimate:
    """Memory, bubble, communication and step time of one feasible layout.

    Activations per rank are what :class:`~lightning_parallel.strategies.activation_checkpointing.
    ActivationMemoryMonitor` measures. At pp=1 it is what waits for backward when backward starts: every layer's
    saved tensors for the dp rank's whole batch, the loss's included. Under pp, the peak over the ends of the
    rank's layers (the loss comes after them, so it is not included): the microbatches
    in flight (:func:`in_flight`) through the rank's layers, plus what the pipeline holds for the whole step:
    the dp rank's input batch (its microbatches are views of it) and one receive buffer per microbatch for each
    stage input (activations) and stage output (gradients).

    Args:
        costs: every pipeline layer's :class:`LayerCost` at this layout's tp.
        stages: the layers of each pipeline stage; stage_ranks: the pp rank that runs each stage.
        dims: (pp, dp, tp); zero_stage: 0..3.
        s: the batch, schedule, precision, device and cost-model settings.
    """
    pp, dp, tp = dims
    m = 1 if pp == 1 else (s.microbatches or 2 * pp)
    virtual = len(stages) // pp
    batch = s.global_batch / dp / m  # samples per microbatch (the whole dp share when pp == 1)
    elem = element_bytes(s.precision)
    est = Estimate(pp, dp, tp, zero_stage, microbatches=m)
    worst = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    flops = 0.0
    for rank, layers in enumerate(rank_layers(len(costs), stages, stage_ranks, pp)):
        keys: dict[str, int] = {}
        for i in layers:
            keys.update(costs[i].params)
        params = sum(keys.values())
        states = model_state_bytes(params, dp, zero_stage, elem, s.optimizer_states)
        act = sum(costs[i].act_fixed + costs[i].act_per_sample * batch for i in layers)
        act *= in_flight(s.schedule, pp, m, rank, virtual)
        if pp == 1:
            act += costs[-1].loss_fixed + costs[-1].loss_per_sample * batch
        else:
            act += costs[0].in_per_sample * batch * m + _recv_buffers(costs, stages, stage_ranks, rank) * batch * m
        est.model_state_per_rank.append(states)
        est.activation_per_rank.append(act)
        est.memory_per_rank.append(states + act)
        worst["dp"] = max(worst["dp"], dp_comm_bytes(params, dp, zero_stage, elem) if dp > 1 else 0.0)
        tp_payload = sum(costs[i].tp_payload_per_sample for i in layers) * batch * m
        worst["tp"] = max(worst["tp"], all_reduce_bytes(tp_payload, tp) if tp > 1 else 0.0)
        worst["pp"] = max(worst["pp"], _pp_sent(costs, stages, stage_ranks, rank, batch * m) if pp > 1 else 0.0)
        flops = max(flops, 3 * m * batch * sum(costs[i].flops_per_sample for i in layers))  # fwd + 2x bwd
    est.comm = worst
    est.bubble = bubble_fraction(pp, m, s.schedule, virtual)
    est.step_time = flops / s.device_flops / (1 - est.bubble) + sum(worst.values()) / s.bandwidth
    return est


def _recv_buffers(costs: Sequence[LayerCost], stages: Sequence[range], ranks: Sequence[int], rank: int) -> float:
    """Bytes per sample of the buffers a pp rank receives into: each stage's input but the first's, each stage's
    output gradient but the last's (torch's pipelining allocates one per microbatch for the whole step)."""
    held = 0.0
    for index, (stage, owner) in enumerate(zip(stages, ranks)):
        if owner == rank:
            held += costs[stage[0]].in_per_sample if index > 0 else 0.0
            held += costs[stage[-1]].out_per_sample if index < len(stages) - 1 else 0.0
    return held


def _pp_sent(
    costs: Sequence[LayerCost], stages: Sequence[range], ranks: Sequence[int], rank: int, samples: float
) -> float:
    """Bytes a pp rank sends per step: each of its stages' outputs forward and input gradients backward."""
    sent = 0.0
    for index, (stage, owner) in enumerate(zip(stages, ranks)):
        if owner != rank:
            continue
        if index < len(stages) - 1:
            sent += costs[stage[-1]].out_per_sample * samples
        if index > 0:
            sent += costs[stage[0] - 1].out_per_sample * samples
    return sent


def recommend(estimates: Sequence[Estimate], device_memory: float, margin: float) -> Estimate | None:
    """The feasible layout with the smallest estimated step time among those that leave ``margin`` of the
    device free; if none does, among those that fit at all. Ties go to the smaller memory."""
    fits = [e for e in estimates if e.feasible]
    roomy = [e for e in fits if e.memory <= (1 - margin) * device_memory]
    pool = roomy or fits
    return min(pool, key=lambda e: (e.step_time, e.memory)) if pool else None
