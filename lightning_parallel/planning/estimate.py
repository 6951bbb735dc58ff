"""Closed-form estimates for a (pp, dp, tp, ep, zero_stage) layout, from a measured per-layer profile. Pure Python.

Everything here is arithmetic on :class:`LayerCost` records (what one pipeline layer holds and does on one tp
rank, measured by :mod:`lightning_parallel.planning.profile`), so it is unit-tested without any process group:

- model states per rank: the ZeRO formulas of the sharding table (``parallel/data/stages.py``), sharded over dp;
  tp and pp divide them through the layer records (a stage holds its layers' tp shard);
- activations per rank: one microbatch's saved bytes times the microbatches in flight of the schedule table
  (``parallel/pipeline/schedules.py``), whose bubble is used too;
- expert parameters (MoE): split over ep, their ZeRO states sharded over the dp/ep ranks holding the same experts;
  the all-to-all of tokens: each MoE layer's rows (tokens x k x d) sent 4 times a step (dispatch and combine,
  forward and backward), (ep-1)/ep of them leaving the rank;
- with LoRA adapters (:mod:`lightning_parallel.planning.adapters`): the frozen base's parameters alone, sharded
  over dp only under ZeRO-3, and the adapters' 16 bytes per parameter sharded as the stage shards them;
- context parallelism: 1/cp of every sample's tokens per rank, the states sharded over dp x cp; HSDP: over one
  replica's ``dp_shard`` ranks, each shard all-reduced across the replicas; sequence parallelism: the norms'
  inputs (measured per layer) split over tp; activation checkpointing: measured by the profile itself;
- communication bytes per step per rank, and a step time under a simple cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_parallel.parallel.data.stages import stage_sharding as zero_stage_of
from lightning_parallel.parallel.pipeline.schedules import schedule_spec
from lightning_parallel.planning.adapters import adapter_comm_bytes, adapter_model_state_bytes

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "fp8")  # fp8: float8 linears over bf16-mixed
# optimizer states per parameter: AdamW keeps exp_avg and exp_avg_sq, SGD with momentum its momentum buffer
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd_no_momentum": 0}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: use one of {', '.join(PRECISIONS)}.")
    return precision


def element_bytes(precision: str) -> int:
    """Bytes of one parameter, gradient or optimizer-state element: the mixed precisions (and ``fp8``, float8
    linears over ``bf16-mixed``) keep fp32 states (autocast casts in the forward), ``bf16-true`` keeps everything
    in bf16."""
    return 2 if check_precision(precision) == "bf16-true" else 4


def shard_degree(dp: int, cp: int = 1, dp_shard: int | None = None) -> int:
    """Ranks ZeRO shards model states over: the data-parallel ranks (HSDP: one replica's ``dp_shard`` of them)
    times the context-parallel ranks, which see the same samples."""
    return (dp_shard or dp) * cp


def all_reduce_bytes(payload: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: 2 * payload * (w-1)/w."""
    return 2 * payload * (world - 1) / world


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
        expert_params: the keys of ``params`` that are MoE expert weights (split over ep).
        a2a_per_sample: bytes of the token rows the layer's MoE layers send to their experts (tokens x k x d),
            one all-to-all's payload.
        adapter_params: LoRA adapter elements on this tp rank (0: every parameter trains; else ``params`` are the
            frozen base's).
        norm_in_per_sample: bytes of the layer's norm inputs, the residual stream that sequence parallelism
            splits over tp (part of ``act_per_sample``).
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
    expert_params: frozenset[str] = frozenset()
    a2a_per_sample: float = 0.0
    adapter_params: int = 0
    norm_in_per_sample: float = 0.0


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
        base_bytes_per_param: with adapters, bytes of one frozen base parameter (None: the precision's element).
        latency: seconds each collective or point-to-point message costs besides its bytes (see
            :func:`message_count`; 0: bytes alone, as on a fast interconnect with large messages).
        activation_checkpointing: ``none``, ``full`` or ``selective``, as the strategy applies it (the profile
            measures each layer checkpointed so).
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
    base_bytes_per_param: int | None = None
    latency: float = 0.0
    activation_checkpointing: str = "none"


@dataclass
class Estimate:
    """One layout's numbers; ``reason`` says why it is infeasible ("" when it is not). ``zero_stage`` is None
    for a split refused before any estimate (the reason holds for every stage)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int | None
    reason: str = ""
    ep: int = 1
    microbatches: int = 1
    memory_per_rank: list[float] = field(default_factory=list)  # per pp rank: model states + activations
    model_state_per_rank: list[float] = field(default_factory=list)
    activation_per_rank: list[float] = field(default_factory=list)
    bubble: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # dp, tp, pp, ep bytes per step, the busiest rank
    expert_state_per_rank: list[float] = field(default_factory=list)  # the experts' part of model_state_per_rank
    step_time: float = math.inf
    messages: float = 0.0  # collectives and pipeline messages of the busiest rank per step (message_count)

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
    ep: int = 1,
    *,
    cp: int = 1,
    dp_shard: int | None = None,
    sequence_parallel: bool = False,
) -> Estimate:
    """Memory, bubble, communication and step time of one feasible layout.

    Activations per rank are what :class:`~lightning_parallel.callbacks.activation.
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
        ep: expert-parallel degree (divides dp).
        cp: context-parallel degree: each rank holds 1/cp of every sample's tokens (and of what scales with them).
        dp_shard: HSDP's shard group (None: all of dp); ZeRO shards over it times cp (:func:`shard_degree`).
        sequence_parallel: the norms' inputs (the residual stream) split over tp too.
    """
    pp, dp, tp = dims
    m = 1 if pp == 1 else (s.microbatches or 2 * pp)
    virtual = len(stages) // pp
    # samples per microbatch (the whole dp share when pp == 1), in tokens' worth: cp splits each sample
    batch = s.global_batch / dp / m / cp
    shard = shard_degree(dp, cp, dp_shard)
    # sequence parallelism's split of the residual stream (counted where the layers keep their norms' inputs)
    sp = tp if sequence_parallel and s.activation_checkpointing == "none" else 1
    elem = element_bytes(s.precision)
    est = Estimate(pp, dp, tp, zero_stage, ep=ep, microbatches=m)
    schedule = schedule_spec(s.schedule)
    worst = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "ep": 0.0}
    flops = messages = 0.0
    for rank, layers in enumerate(rank_layers(len(costs), stages, stage_ranks, pp)):
        keys: dict[str, int] = {}
        expert_keys: set[str] = set()
        for i in layers:
            keys.update(costs[i].params)
            expert_keys |= costs[i].expert_params
        experts = sum(n for k, n in keys.items() if k in expert_keys) // ep  # E/ep experts on this rank
        params = sum(n for k, n in keys.items() if k not in expert_keys)
        adapters = sum(costs[i].adapter_params for i in layers)
        states, expert_states, dp_sent = _model_states(params, experts, adapters, (shard, ep, zero_stage), elem, s)
        if shard < dp * cp:  # HSDP: each shard all-reduced across the replicas
            dp_sent += all_reduce_bytes(elem * (params / shard + experts / max(1, shard // ep)), dp * cp // shard)
        est.expert_state_per_rank.append(expert_states)
        act = sum(_saved_bytes(costs[i], batch, sp) for i in layers)
        act *= schedule.in_flight(pp, m, rank, virtual)
        if pp == 1:
            act += costs[-1].loss_fixed + costs[-1].loss_per_sample * batch
        else:
            act += costs[0].in_per_sample * batch * m + _recv_buffers(costs, stages, stage_ranks, rank) * batch * m
        est.model_state_per_rank.append(states)
        est.activation_per_rank.append(act)
        est.memory_per_rank.append(states + act)
        worst["dp"] = max(worst["dp"], dp_sent)
        a2a = sum(costs[i].a2a_per_sample for i in layers) * batch * m
        worst["ep"] = max(worst["ep"], 4 * a2a * (ep - 1) / ep)
        tp_payload = sum(costs[i].tp_payload_per_sample for i in layers) * batch * m
        worst["tp"] = max(worst["tp"], all_reduce_bytes(tp_payload, tp) if tp > 1 else 0.0)
        worst["pp"] = max(worst["pp"], _pp_sent(costs, stages, stage_ranks, rank, batch * m) if pp > 1 else 0.0)
        # forward + backward at twice its cost; a frozen base skips its weight gradients: backward about a forward
        passes = 2 if adapters else 3
        flops = max(flops, passes * m * batch * sum(costs[i].flops_per_sample for i in layers))
        messages = max(messages, message_count([costs[i] for i in layers], (pp, dp, tp, ep), zero_stage, m, virtual))
    est.comm, est.messages = worst, messages
    est.bubble = schedule.bubble(pp, m, virtual)
    est.step_time = flops / s.device_flops / (1 - est.bubble) + sum(worst.values()) / s.bandwidth
    est.step_time += messages * s.latency
    return est


def _saved_bytes(cost: LayerCost, batch: float, sp: int) -> float:
    """Bytes one layer keeps for backward for ``batch`` samples, its norms' inputs split over ``sp`` ranks."""
    return cost.act_fixed + (cost.act_per_sample - cost.norm_in_per_sample * (1 - 1 / sp)) * batch


def message_count(
    held: Sequence[LayerCost], degrees: tuple[int, int, int, int], zero_stage: int, microbatches: int, virtual: int
) -> float:
    """Collectives and pipeline messages one rank issues per step, each costing :attr:`Settings.latency` besides its
    bytes (what dominates small messages over gloo or a slow link): dp one gradient all-reduce (ZeRO 0), a
    reduce-scatter and an all-gather (ZeRO 1-2), two all-gathers and a reduce-scatter per layer (ZeRO-3); tp four
    all-reduces per layer with tp traffic per microbatch (a GPT block's count: two forward, two backward); ep four
    all-to-alls per layer with routed rows per microbatch; pp a send and a receive each way per stage and
    microbatch.

    Args:
        held: the :class:`LayerCost` of each layer the rank holds.
        degrees: (pp, dp, tp, ep); zero_stage: 0..3; microbatches: per step; virtual: stages per rank.
    """
    pp, dp, tp, ep = degrees
    count = 0.0
    if dp > 1:
        count += {0: 1, 1: 2, 2: 2}.get(zero_stage, 3 * len(held))
    if tp > 1:
        count += 4 * microbatches * sum(1 for c in held if c.tp_payload_per_sample)
    if ep > 1:
        count += 4 * microbatches * sum(1 for c in held if c.a2a_per_sample)
    if pp > 1:
        count += 4 * microbatches * virtual
    return count


def _model_states(
    params: int, experts: int, adapters: int, degrees: tuple[int, int, int], elem: int, s: Settings
) -> tuple[float, float, float]:
    """(model-state bytes, the experts' part of them, dp bytes sent per step) of one rank holding ``params``
    non-expert and ``experts`` expert elements (its tp shard of its layers), ``degrees`` = (dp, ep, zero_stage).
    With ``adapters`` the parameters are a frozen base (:mod:`lightning_parallel.planning.adapters`); the experts
    are sharded over the dp / ep ranks holding the same ones."""
    dp, ep, stage = degrees
    sharding = zero_stage_of(stage)
    if not adapters:
        expert_states = (
            sharding.state_bytes_exact(experts, max(1, dp // ep), elem, s.optimizer_states) if experts else 0
        )
        states = sharding.state_bytes_exact(params, dp, elem, s.optimizer_states) + expert_states
        ratio = 0.5 if s.precision in ("bf16-mixed", "fp8") else 1.0  # ZeRO-3 gathers bf16 parameters (fsdp.py)
        sent = sharding.comm_bytes(params * elem, dp, ratio) + sharding.comm_bytes(experts * elem, dp // ep, ratio)
        return states, expert_states, sent
    base = s.base_bytes_per_param or elem
    frozen = {"zero_stage": stage, "tp": 1, "pp": 1, "base_bytes_per_param": base}  # counts are this rank's already
    expert_states = adapter_model_state_bytes(experts, 0, dp=dp // ep, **frozen)
    states = adapter_model_state_bytes(params, adapters, dp=dp, **frozen) + expert_states
    sent = adapter_comm_bytes(params * base, adapters, zero_stage=stage, dp=dp)
    sent += adapter_comm_bytes(experts * base, 0, zero_stage=stage, dp=dp // ep)
    return states, expert_states, sent


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
