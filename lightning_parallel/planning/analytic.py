"""The analytic planner: memory per rank and step time of a layout from a model's shape alone (no profile), for
models too large to build on the host. Pure Python arithmetic.

- Parameters and FLOPs from :class:`~lightning_parallel.planning.hf_config.ModelShape` (dense, grouped-query,
  latent attention, routed and shared experts).
- Activations per layer: Korthikanti et al. (2022), term by term (so GQA, gated MLPs and experts fit in), with
  sequence parallelism, cp's share of the sequence, and none / selective (attention core) / full checkpointing;
  times the microbatches the pipeline schedule keeps in flight (the schedule table's count).
- Model states: the ZeRO sharding table's bytes, sharded over dp x cp (HSDP: dp_shard x cp); experts over ep.
- Step time: each GEMM at the device's large-GEMM efficiency times ``d / (d + GEMM_ROLLOFF)`` per dimension (small
  per-GPU matmuls run slower), attention at the fused kernels' efficiency (or as batched GEMMs plus its scores'
  memory traffic when materialized), elementwise work at HBM bandwidth (its traffic from the activations), tp
  collectives not overlapped, cp ring transfers hidden behind attention, ep all-to-alls exposed, pipeline
  microbatches and bubble ``(pp-1)/v`` microbatch times, ZeRO-3 gathers and the gradient reduction after the last
  microbatch hidden behind at most the calibrated fraction of the compute (:func:`.timemodel.exposed_dp`, the
  constants of :data:`.timemodel.CALIBRATION`, shared with the simulator).
- FP8 (``precision="fp8"``, :mod:`.fp8`): the converted linears' matmuls at the device's fp8 peak, the rest at
  bf16's; ZeRO-3's gathers of converted weights in 1 byte with ``fsdp_float8_all_gather``.
- Muon (``optimizer="muon"``, :mod:`.muon`): one momentum buffer per matrix element, and the optimizer step's
  owner exchange and Newton-Schulz iterations, exposed (``times["muon"]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_parallel.parallel.data.stages import stage_sharding as zero_stage_of
from lightning_parallel.parallel.pipeline.schedules import schedule_spec
from lightning_parallel.planning.adapters import adapter_model_state_bytes
from lightning_parallel.planning.cluster import Cluster, Device
from lightning_parallel.planning.estimate import element_bytes, shard_degree
from lightning_parallel.planning.fp8 import (
    CAST_BYTES,
    FP8,
    amax_bytes,
    check_fp8_device,
    converted_kinds,
    converted_params,
    fp8_flop_share,
    gather_payload,
)
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.layout import Layout, Workload, microbatches
from lightning_parallel.planning.matrices import ROW_PARALLEL, layer_matrices
from lightning_parallel.planning.muon import NS_BYTES, exchange_bytes, muon_params, ns_flops
from lightning_parallel.planning.timemodel import exposed_dp

GEMM_ROLLOFF = 64  # a GEMM dimension d runs at d / (d + 64) of the large-GEMM rate (tile and wave quantization)
TRAFFIC = 2.0  # HBM bytes moved per byte of activations kept, forward (elementwise reads and writes); 2x backward


@dataclass
class AnalyticEstimate:
    """One layout's figures (per step unless said).

    Attributes:
        layout: what was estimated; reason: why it cannot run ("" if it can).
        memory: bytes on the busiest rank; states, activations: its parts.
        recompute: the part of ``activations`` a fully checkpointed layer rebuilds during its backward (the rest
            is what the forward leaves for backward, what ``ActivationMemoryMonitor`` measures).
        step_time: seconds; times: its parts (compute, bubble, tp, cp, ep, pp, dp, optimizer; muon with Muon).
        tokens_per_s: for the whole job; mfu: the FLOPs the model needs (6 N per token and causal attention, no
            recomputation) per second per device over the device's peak (under fp8, :func:`mixed_peak`).
        tflops_per_gpu: FLOP/s per device as the workload's ``flops_count`` counts them (``megatron``: full
            attention and the recomputed forward, as Megatron-LM's tables; ``causal``: the FLOPs MFU counts).
        bound: the largest part of the step.
        counts: per step on the busiest rank: ``fp8_flop_share`` (of the FLOPs MFU counts, :mod:`.fp8`),
            ``zero3_gather_bytes`` (ZeRO-3's parameter all-gathers and, under fp8, their amax all-reduces), and
            with Muon ``muon_exchange_bytes`` and ``muon_ns_flops`` (:mod:`.muon`).
    """

    layout: Layout
    reason: str = ""
    memory: float = 0.0
    states: float = 0.0
    activations: float = 0.0
    recompute: float = 0.0
    step_time: float = math.inf
    times: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    tflops_per_gpu: float = 0.0
    bound: str = ""
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return not self.reason


class _Rank:
    """Per-layer quantities of one layout on one rank, for one microbatch of ``b`` samples."""

    def __init__(self, shape: ModelShape, cluster: Cluster, x: Layout, work: Workload) -> None:
        self.s, self.c, self.x, self.w = shape, cluster, x, work
        self.a = work.act_bytes
        self.b = work.global_batch // x.dp // microbatches(x, work)
        self.tokens = self.b * work.seq_len / x.cp  # T: tokens through the rank per microbatch
        self.r = x.tp if x.sequence_parallel else 1  # what divides the replicated (h-wide) activations
        self.fp8 = converted_kinds(shape, cluster.device) if work.precision == FP8 else frozenset()  # run in fp8
        self.dense, self.moe = _stage_layers(shape, x)
        # Muon's matrix elements and the fp8-converted weights' (elements, tensors) on this rank (its tp shard)
        self.muon = muon_params(shape, self.dense, self.moe) / x.tp if work.optimizer == "muon" else 0.0
        fp8_held, self.fp8_tensors = converted_params(shape, self.dense, self.moe) if self.fp8 else (0, 0)
        self.fp8_held = fp8_held / x.tp

    # ----- memory -----
    def layer_activations(self, moe: bool, mode: str | None = None, scores: bool = True) -> float:
        """Bytes one layer keeps for backward (Korthikanti et al. 2022, term by term) under checkpointing ``mode``
        (None: the layout's); ``scores=False`` leaves out the attention scores."""
        s, a, T, t = self.s, self.a, self.tokens, self.x.tp
        mode = mode or self.x.activation_checkpointing
        mask = T * s.hidden if s.dropout else 0.0
        if mode == "full":
            return a * T * s.hidden / self.r
        repl = 2 * (2 * a * T * s.hidden + mask)  # norm inputs, qkv and fc1 inputs, two dropout masks
        attn = a * T * (s.heads * s.qk_head_dim + s.kv_heads * (s.qk_head_dim + s.v_head_dim) + s.heads * s.v_head_dim)
        shard = attn + self._mlp_activations(moe) + (self.scores(mode) if scores else 0.0)
        return repl / self.r + shard / t + (4 * T * s.experts if moe else 0.0)  # the router's fp32 logits

    def _mlp_activations(self, moe: bool) -> float:
        s, a, T = self.s, self.a, self.tokens
        per_width = (3 if s.gated else 2) * a * T  # fc1 output (gate and up; GeLU input) and fc2 input
        if not moe:
            return per_width * s.ffn
        return per_width * (s.top_k * s.moe_ffn + s.shared_ffn) + a * T * s.top_k * s.hidden * self.x.tp

    def scores(self, mode: str) -> float:
        """The attention scores kept (softmax output, dropout mask and output) when they are materialized, over
        all tp ranks."""
        s, w = self.s, self.w
        if w.attention == "flash" or mode != "none":
            return 4.0 * self.tokens * s.heads  # the softmax statistics
        return s.heads * self.tokens * w.seq_len * (self.a + (1 + self.a if s.dropout else 0))

    def working_layer(self, moe: bool) -> float:
        """What a fully checkpointed layer rebuilds during its backward."""
        return self.layer_activations(moe, "none") if self.x.activation_checkpointing == "full" else 0.0

    def logits(self) -> float:
        return 4 * self.tokens * self.s.vocab / self.x.tp * 2  # fp32 logits and their log-softmax

    # ----- time -----
    def gemm(self, m: float, k: float, n: float, count: float = 1.0, kind: str = "") -> float:
        """Seconds of ``count`` (m x k) @ (k x n) matmuls; a ``kind`` of linears converted to fp8 at fp8's peak."""
        d = self.c.device
        eff = self.c.efficiency("gemm") * math.prod(v / (v + GEMM_ROLLOFF) for v in (m, k, n))
        peak = d.fp8_flops if kind in self.fp8 else d.peak_flops
        return count * 2 * m * k * n / (peak * eff) if m and k and n else 0.0

    def layer_forward(self, moe: bool) -> tuple[float, float]:
        """(seconds of one layer's forward for one microbatch, the attention core's part of it)."""
        s, T, t = self.s, self.tokens, self.x.tp
        attn_in = (s.attention_params() - s.heads * s.v_head_dim * s.hidden) / s.hidden
        time = self.gemm(T, s.hidden, attn_in / t, kind="attention")
        time += self.gemm(T, s.heads * s.v_head_dim / t, s.hidden, kind="attention")
        core = self.attention_core()
        width = 2 if s.gated else 1
        if moe:
            local = s.experts / self.x.ep
            per_expert = T * s.top_k * self.x.ep / s.experts  # tokens each local expert gets (uniform routing)
            time += self.gemm(per_expert, s.hidden, width * s.moe_ffn / t, local, kind="expert")
            time += self.gemm(per_expert, s.moe_ffn / t, s.hidden, local, kind="expert")
            time += self.gemm(T, s.hidden, s.experts)  # the router
        ffn = s.shared_ffn if moe else s.ffn
        time += self.gemm(T, s.hidden, width * ffn / t, kind="mlp") + self.gemm(T, ffn / t, s.hidden, kind="mlp")
        hbm = self.c.device.hbm_bandwidth
        time += TRAFFIC * self.layer_activations(moe, "none", scores=False) / hbm + self.fp8_casts(moe) / hbm
        return time + core, core

    def fp8_casts(self, moe: bool) -> float:
        """HBM bytes of one layer's forward casts to fp8: each converted linear's input read for its amax, read
        again and written in 1 byte (:data:`.fp8.CAST_BYTES` an element; the backward's casts of the output
        gradients and the transposes follow as twice it, as its matmuls do)."""
        inputs = sum(m.cols / (self.x.tp if m.name in ROW_PARALLEL else 1) * (self.s.top_k if m.kind == "expert" else 1)
                     for m in layer_matrices(self.s, moe) if m.kind in self.fp8 and m.numel)  # fmt: skip
        return CAST_BYTES * self.tokens * inputs

    def attention_core(self) -> float:
        """Forward seconds of softmax(QK^T)V on this rank (causal: fused kernels skip half the blocks)."""
        s, w, d, T = self.s, self.w, self.c.device, self.tokens
        heads = s.heads / self.x.tp
        flops = 2 * T * w.seq_len * heads * (s.qk_head_dim + s.v_head_dim)
        if w.attention == "flash":
            return flops / 2 / (d.peak_flops * self.c.efficiency("attention"))
        score_bytes = heads * T * w.seq_len * (self.a + (1 + self.a if s.dropout else 0))
        gemms = self.gemm(T, s.qk_head_dim, w.seq_len, heads) + self.gemm(T, w.seq_len, s.v_head_dim, heads)
        return gemms + TRAFFIC * score_bytes / d.hbm_bandwidth

    def layer_comm(self, moe: bool, core: float) -> dict[str, float]:
        """Exposed seconds of one layer's collectives per microbatch, forward and backward (and recomputation)."""
        s, x, c, a, T = self.s, self.x, self.c, self.a, self.tokens
        passes = 3 if x.activation_checkpointing == "full" else 2  # forward, (recomputed forward), backward
        tp = 2 * passes * c.all_reduce_time(a * T * s.hidden, 1, x.tp)
        cp = 0.0
        if x.cp > 1 and x.cp_mode == "ring":  # keys and values around the ring, hidden behind the attention core
            kv = a * T * s.kv_heads * (s.qk_head_dim + s.v_head_dim) / x.tp
            ring = (x.cp - 1) * kv / c.bandwidth(x.tp, x.cp)
            cp = max(0.0, ring - core) + max(0.0, 2 * ring - 2 * core)
        elif x.cp > 1:  # Ulysses: q, k, v and the output re-split over heads, forward and backward
            qkvo = a * T * (2 * s.heads * s.qk_head_dim + s.kv_heads * (s.qk_head_dim + s.v_head_dim)) / x.tp
            cp = passes * c.gather_time(qkvo, x.tp, x.cp)
        ep = 2 * passes * c.gather_time(a * T * s.top_k * s.hidden, x.tp * x.cp, x.ep) if moe else 0.0
        return {"tp": tp, "cp": cp, "ep": ep}


def _stage_layers(shape: ModelShape, x: Layout) -> tuple[int, int]:
    """(dense, MoE) layers on the busiest pp rank (uniform stages; the MoE layers spread evenly)."""
    per_rank = math.ceil(shape.layers / x.pp)
    moe = math.ceil(shape.moe_layers * per_rank / shape.layers)
    return per_rank - moe, moe


def _states(shape: ModelShape, x: Layout, work: Workload, dense: int, moe: int) -> tuple[float, float, float]:
    """(model-state bytes of the busiest rank, the parameters it trains, the parameters it holds); with LoRA the
    base is frozen (:mod:`lightning_parallel.planning.adapters`) and only the adapters train."""
    base_dense, _ = shape.layer_params(False)
    base_moe, experts = shape.layer_params(True)
    embedding = shape.embedding_params() - (shape.vocab * shape.hidden if x.pp > 1 and not shape.tied else 0)
    params = (dense * base_dense + moe * base_moe + embedding) / x.tp  # the first stage: the embedding (and head)
    expert_params = moe * experts / x.ep / x.tp
    shard = shard_degree(x.dp, x.cp, x.dp_shard)
    sharding, elem = zero_stage_of(x.zero_stage), element_bytes(work.precision)
    if work.lora_rank:
        adapters = dense * shape.lora_params(work.lora_rank, False) + moe * shape.lora_params(work.lora_rank, True)
        adapters //= x.tp
        frozen = {"zero_stage": x.zero_stage, "base_bytes_per_param": work.base_bytes_per_param or elem}
        states = adapter_model_state_bytes(int(params), adapters, dp=shard, **frozen)
        states += adapter_model_state_bytes(int(expert_params), 0, dp=max(1, shard // x.ep), **frozen)
        return states, adapters, params + expert_params
    muon = muon_params(shape, dense, moe) // x.tp if work.optimizer == "muon" else 0  # one momentum buffer each
    states = sharding.state_bytes_exact(int(params) - muon, shard, elem, work.optimizer_states)
    states += sharding.state_bytes_exact(muon, shard, elem, 1) if muon else 0
    states += sharding.state_bytes_exact(int(expert_params), max(1, shard // x.ep), elem, work.optimizer_states)
    return states, params + expert_params, params + expert_params


def evaluate(shape: ModelShape, cluster: Cluster, x: Layout, work: Workload) -> AnalyticEstimate:
    """Memory per rank, step time, throughput and MFU of one valid layout (see the module's docstring).

    Args:
        shape: the model; cluster: the devices; x: the layout (checked by :func:`.layout.layout_error` first);
        work: sequence, batch, precision and attention kernel.
    """
    check_fp8_device(cluster.device, work.precision)
    r, est = _Rank(shape, cluster, x, work), AnalyticEstimate(x)
    m, v = microbatches(x, work), x.virtual
    dense, moe = _stage_layers(shape, x)
    states, trained, held = _states(shape, x, work, dense, moe)
    in_flight = schedule_spec(x.pp_schedule).in_flight(x.pp, m, 0, v) if x.pp > 1 else 1.0
    acts = in_flight * (dense * r.layer_activations(False) + moe * r.layer_activations(True))
    est.recompute = r.working_layer(moe > 0)
    acts += est.recompute + (r.logits() if x.pp == 1 else 0.0)
    gathered = 0.0
    if x.zero_stage == 3:  # in the compute dtype: the unit being used and the one prefetched, or all of them
        units = 2 if x.reshard_after_forward else dense + moe
        gathered = units * work.act_bytes * held / max(1, dense + moe)
    est.states, est.activations, est.memory = states, acts, states + acts + gathered
    if est.memory > (1 - work.margin) * cluster.device.memory:
        est.reason = f"needs {est.memory / 1e9:.1f} GB of {cluster.device.memory / 1e9:.1f} GB (margin {work.margin})"
    est.times = _step_times(r, dense, moe, (trained, held), (m, v))
    est.counts = _counts(r, held, m)
    if work.optimizer == "muon":
        est.times["muon"], est.counts["muon_exchange_bytes"], est.counts["muon_ns_flops"] = _muon(r)
    est.step_time = sum(est.times.values())
    est.bound = max(est.times, key=est.times.__getitem__)
    count_throughput(est, shape, cluster, work)
    return est


def _step_times(r: _Rank, dense: int, moe: int, params: tuple[float, float], mv: tuple[int, int]) -> dict[str, float]:
    x, c, s, (m, v) = r.x, r.c, r.s, mv
    recompute = {"none": 0.0, "selective": 1.0, "full": 1.0}[x.activation_checkpointing]
    compute, comm = 0.0, {"tp": 0.0, "cp": 0.0, "ep": 0.0}
    for count, is_moe in ((dense, False), (moe, True)):
        if not count:
            continue
        fwd, core = r.layer_forward(is_moe)
        redo = fwd if x.activation_checkpointing == "full" else core * recompute
        compute += count * ((2 if r.w.lora_rank else 3) * fwd + redo)  # a frozen base: no weight gradients
        for k, t in r.layer_comm(is_moe, core).items():
            comm[k] += count * t
    compute += r.gemm(r.tokens, s.hidden, s.vocab / x.tp, 3)  # the output head
    p2p = 2 * v * r.a * r.tokens * s.hidden / r.r / c.bandwidth(x.tp * x.cp * x.dp, 2) if x.pp > 1 else 0.0
    per_mb = compute + sum(comm.values()) + p2p
    times = {"compute": m * compute, "bubble": (x.pp - 1) / v * per_mb}
    times.update({k: m * t for k, t in comm.items()})
    times["pp"] = m * p2p
    times["dp"] = _dp_time(r, params, compute, m, dense + moe)
    per_param = (2 + r.w.optimizer_states) * (params[0] - r.muon) + (2 + 1) * r.muon  # Muon: one state tensor
    states_bytes = element_bytes(r.w.precision) * per_param / shard_degree(x.dp, x.cp, x.dp_shard)
    times["optimizer"] = 2 * states_bytes / c.device.hbm_bandwidth
    return times


def _dp_time(r: _Rank, params: tuple[float, float], compute: float, m: int, units: int) -> float:
    """Exposed seconds of the data-parallel reduction of the trained ``params[0]`` (and ZeRO-3's gathers of all
    ``params[1]``) per step, ``units`` collectives each (one per layer: FSDP's units, the buckets)."""
    x, c = r.x, r.c
    stride, shard = x.tp, shard_degree(x.dp, x.cp, x.dp_shard)
    grads = r.a * params[0]
    weights = gather_payload(params[1], r.fp8_held, r.w.fsdp_float8_all_gather) if r.fp8 else r.a * params[1]
    if x.zero_stage:
        reduce = c.gather_time(grads, stride, shard, units)
    else:
        reduce = c.all_reduce_time(grads, stride, shard, units)
    if x.dp_shard and x.dp_shard < x.dp:  # HSDP: the shard all-reduced across the replicas
        reduce += c.all_reduce_time(grads / shard, stride * shard, x.dp // x.dp_shard, units)
    if x.zero_stage in (1, 2):  # the updated parameters gathered back
        reduce += c.gather_time(grads, stride, shard, units)
    gathers = 0.0
    if x.zero_stage == 3:  # parameter all-gathers per microbatch, prefetched behind each microbatch's compute
        gathers = (2 if x.reshard_after_forward else 1) * c.gather_time(weights, stride, shard, units)
    hide = x.overlap_grad_reduce or x.zero_stage == 3
    return exposed_dp(reduce, gathers, compute, c.calibration.overlap, hide, m)


def _counts(r: _Rank, held: float, m: int) -> dict[str, float]:
    """The FLOP share in fp8 and the bytes ZeRO-3's all-gathers send per step (:attr:`AnalyticEstimate.counts`)."""
    x, w = r.x, r.w
    counts = {"fp8_flop_share": fp8_flop_share(r.s, w.seq_len, r.c.device) if r.fp8 else 0.0, "zero3_gather_bytes": 0.0}
    shard = shard_degree(x.dp, x.cp, x.dp_shard)
    if x.zero_stage == 3 and shard > 1:
        payload = gather_payload(held, r.fp8_held, w.fsdp_float8_all_gather) if r.fp8 else r.a * held
        amax = amax_bytes(r.fp8_tensors, shard) if w.fsdp_float8_all_gather else 0.0
        counts["zero3_gather_bytes"] = (
            m * (2 if x.reshard_after_forward else 1) * (payload * (shard - 1) / shard + amax)
        )
    return counts


def _muon(r: _Rank) -> tuple[float, float, float]:
    """(exposed seconds, bytes sent, Newton-Schulz FLOPs) of the Muon step on the busiest rank (:mod:`.muon`), each
    matrix orthogonalized once on a balanced owner: ZeRO 1-3 over the dp shard group (HSDP: over replicas x shards),
    ZeRO-3 with tp over dp x tp, tp at ZeRO-0 over the tp group, whole matrices at ZeRO-0 over the dp replicas."""
    x, c = r.x, r.c
    whole, b = r.muon * x.tp, NS_BYTES  # the stage's Muon matrices, whole; the wire dtype (ns_dtype)
    shard = shard_degree(x.dp, x.cp, x.dp_shard)
    replicas = max(1, x.dp // x.dp_shard) if x.zero_stage and x.dp_shard else 1
    if x.zero_stage and x.tp > 1:  # dp x tp: over dp, then tp, then back over dp
        world = shard * x.tp
        sent = 2 * b * whole * ((shard - 1) / shard + (x.tp - 1) / x.tp) / world
        comm = 2 * c.gather_time(b * whole / world, x.tp, shard) + 2 * c.gather_time(b * whole / world, 1, x.tp)
    elif x.zero_stage and replicas > 1:  # HSDP: within the shard group, then the results across the replicas
        world = replicas * shard
        sent = exchange_bytes(whole / replicas, shard) + b * (replicas - 1) * whole / world
        comm = 2 * c.gather_time(b * whole / world, x.tp, shard) + c.gather_time(
            b * whole / world, x.tp * shard, replicas
        )
    elif x.zero_stage or x.tp > 1:  # one group splits every matrix: to the owners and back
        world, stride = (shard, x.tp) if x.zero_stage else (x.tp, 1)
        sent = exchange_bytes(whole, world)
        comm = 2 * c.gather_time(b * whole / world, stride, world)
    else:  # whole on every dp rank: each owner's results sent to the others (as one all-gather)
        world = shard
        sent = b * (world - 1) * whole / world if world > 1 else 0.0
        comm = c.gather_time(b * whole / world, x.tp, world) if world > 1 else 0.0
    flops = ns_flops(r.s, r.dense, r.moe, world)
    return comm + flops / (c.device.peak_flops * c.efficiency("gemm")), sent, flops


def mixed_peak(shape: ModelShape, device: Device, work: Workload) -> float:
    """The peak MFU divides by: the device's bf16 peak, or under fp8 the rate at which the counted FLOPs would run
    at the peaks, ``1 / (f / fp8_peak + (1 - f) / bf16_peak)`` for the fp8 share ``f``."""
    if work.precision != FP8:
        return device.peak_flops
    share = fp8_flop_share(shape, work.seq_len, device)
    return 1.0 / (share / device.fp8_flops + (1 - share) / device.peak_flops)


def count_throughput(est: AnalyticEstimate, shape: ModelShape, cluster: Cluster, work: Workload) -> None:
    """Tokens/s; MFU from the FLOPs the model needs (6 N per token, causal attention: half the score matrix);
    TFLOP/s per GPU as ``work.flops_count`` says the source counts them."""
    tokens = work.global_batch * work.seq_len
    attn = 2 * work.seq_len * shape.heads * (shape.qk_head_dim + shape.v_head_dim) * shape.layers  # per token fwd
    attn_counted = attn if work.flops_count == "megatron" else attn / 2
    layer_fwd = 2 * (shape.active_params() - shape.vocab * shape.hidden) + attn_counted
    passes = 2 if work.lora_rank else 3  # forward and backward (without weight gradients under LoRA)
    counted = tokens * (2 * passes * shape.active_params() + passes * attn_counted)
    if work.flops_count == "megatron":  # with the recomputed forward
        counted += {"none": 0.0, "selective": tokens * attn, "full": tokens * layer_fwd}[
            est.layout.activation_checkpointing
        ]
    est.tokens_per_s = tokens / est.step_time
    est.mfu = tokens * passes * (2 * shape.active_params() + attn / 2) / est.step_time / cluster.gpus
    est.mfu /= mixed_peak(shape, cluster.device, work)
    est.tflops_per_gpu = counted / est.step_time / cluster.gpus / 1e12
