"""A layout and a workload for the analytic planner (:mod:`.analytic`), in :class:`ParallelConfig`'s field names,
and their checks. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, fields

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, schedule_spec
from lightning_parallel.parallel.sections import recipe_key
from lightning_parallel.planning.estimate import check_precision
from lightning_parallel.planning.hf_config import ModelShape

CHECKPOINTING = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Layout:
    """One layout, named as :class:`~lightning_parallel.parallel.config.ParallelConfig` names its fields.

    Attributes:
        tp, pp, dp, cp, ep: the degrees (ep divides dp).
        zero_stage: 0-3; dp_shard: HSDP's shard group inside dp (None: all of dp).
        sequence_parallel: norms and the residual stream split over tp too.
        activation_checkpointing: none, selective (the attention core recomputed, Korthikanti et al.) or full.
        pp_schedule, pp_virtual_stages: the pipeline schedule and its stages per rank (None: 1, or 2 interleaved).
        microbatches: per pipeline step and dp rank (None: as many as samples, microbatch size 1).
        cp_mode: ring or ulysses.
        overlap_grad_reduce: the gradient reduction overlaps the last microbatch's backward.
        reshard_after_forward: ZeRO-3 gathers parameters again for backward.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    dp_shard: int | None = None
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int | None = None
    microbatches: int | None = None
    cp_mode: str = "ring"
    overlap_grad_reduce: bool = False
    reshard_after_forward: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def virtual(self) -> int:
        return schedule_spec(self.pp_schedule).stages_per_rank(self.pp_virtual_stages) if self.pp > 1 else 1

    def describe(self) -> str:
        default = Layout()
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        for f in fields(self):
            if f.name not in ("tp", "pp", "dp") and getattr(self, f.name) != getattr(default, f.name):
                parts.append(f"{f.name}={getattr(self, f.name)}")
        return ",".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains.

    Attributes:
        seq_len: tokens per sample.
        global_batch: samples per step.
        precision: Lightning's precision flag (activations in 2 bytes but for ``32-true``).
        attention: ``flash`` (fused, causal blocks skipped, no scores kept) or ``materialized`` (the scores
            tensor written, soft-maxed and kept, as Megatron-LM did in 2021).
        optimizer_states: optimizer-state tensors per parameter (AdamW: 2).
        margin: the fraction of device memory to keep free.
        flops_count: how TFLOP/s per GPU are counted: ``causal`` (what the model needs: 6 N per token and half
            the attention score matrix) or ``megatron`` (Narayanan et al.: the full score matrix and the
            recomputed forward, 96 B s l h^2 (1 + s/6h + V/16lh) for GPT).
        lora_rank: LoRA adapters of this rank (0: every parameter trains), the base frozen in
            ``base_bytes_per_param`` bytes (None: the precision's element).
        optimizer: ``adamw`` (``optimizer_states`` per parameter) or ``muon`` (MuonAdamW: one momentum buffer per
            matrix element, AdamW's on the rest, the owner exchange and Newton-Schulz; :mod:`.muon`).
        fsdp_float8_all_gather: with ``precision="fp8"``, ZeRO-3 gathers the converted linears' weights in fp8
            (:mod:`.fp8`).
    """

    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    attention: str = "flash"
    optimizer_states: int = 2
    margin: float = 0.1
    flops_count: str = "causal"
    lora_rank: int = 0
    base_bytes_per_param: int | None = None
    optimizer: str = "adamw"
    fsdp_float8_all_gather: bool = False

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown to the planner: use {' or '.join(OPTIMIZERS)}.")
        if self.optimizer == "muon" and self.lora_rank:
            raise ValueError("optimizer=muon with lora_rank: the planner counts Muon for full training; plan adamw.")
        if self.fsdp_float8_all_gather and self.precision != "fp8":
            raise ValueError(
                f"fsdp_float8_all_gather gathers fp8 weights, and precision={self.precision!r}: set precision=fp8."
            )
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention={self.attention!r} is unknown: use 'flash' or 'materialized'.")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank} is not a rank: give 1 or more (0: full training).")
        if self.flops_count not in ("causal", "megatron"):
            raise ValueError(f"flops_count={self.flops_count!r} is unknown: use 'causal' or 'megatron'.")
        if self.seq_len < 1 or self.global_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and global_batch={self.global_batch} must be at least 1.")

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2


_BOOLS = {"true": True, "false": False, "1": True, "0": False}


def parse_layout(text: str) -> Layout:
    """``tp=8,pp=8,dp=12,zero_stage=1`` (ParallelConfig's field names) into a :class:`Layout`."""
    kinds = {f.name: f.type for f in fields(Layout)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in kinds or not value:
            raise ValueError(f"--layout item {item!r}: write name=value with a name among {', '.join(kinds)}.")
        kind = str(kinds[key])
        if "bool" in kind:
            if value.lower() not in _BOOLS:
                raise ValueError(f"--layout {key}={value!r}: write true or false.")
            values[key] = _BOOLS[value.lower()]
        elif "int" in kind:
            values[key] = None if value.lower() == "none" else int(value)
        else:
            values[key] = value
    return Layout(**values)  # type: ignore[arg-type]


def layout_error(shape: ModelShape, layout: Layout, work: Workload, gpus: int, gpus_per_node: int) -> str:
    """Why ``layout`` cannot run ``shape`` on ``gpus`` devices ("" if it can)."""
    x, world = layout, layout.world
    if world != gpus:
        return f"tp({x.tp}) * pp({x.pp}) * dp({x.dp}) * cp({x.cp}) = {world} != gpus({gpus})"
    if shape.heads % x.tp or (shape.kv_heads % x.tp and x.tp % shape.kv_heads):
        return f"tp={x.tp} divides neither the {shape.heads} heads nor the {shape.kv_heads} kv heads"
    if x.tp > gpus_per_node:
        return f"tp={x.tp} spans nodes of {gpus_per_node}"
    if x.ep > 1 and (not shape.experts or shape.experts % x.ep or x.dp % x.ep):
        return f"ep={x.ep} must divide dp={x.dp} and the {shape.experts} experts"
    if x.dp_shard is not None and (x.dp % x.dp_shard or not x.zero_stage):
        return f"dp_shard={x.dp_shard} must divide dp={x.dp} and needs zero_stage 1-3"
    if x.pp_schedule not in SCHEDULES or x.activation_checkpointing not in CHECKPOINTING:
        return f"pp_schedule {x.pp_schedule!r} or activation_checkpointing {x.activation_checkpointing!r} unknown"
    if x.pp * x.virtual > shape.layers:
        return f"pp({x.pp}) * virtual stages({x.virtual}) > {shape.layers} layers"
    if work.seq_len % (2 * x.cp) or x.cp_mode not in ("ring", "ulysses"):
        return f"cp={x.cp} ({x.cp_mode}) must split seq_len={work.seq_len} in 2 cp chunks"
    if x.cp_mode == "ulysses" and (shape.heads // x.tp) % x.cp:
        return f"cp={x.cp} ulysses must divide the {shape.heads // x.tp} heads per tp rank"
    if work.optimizer == "muon" and x.tp > 1 and int(x.zero_stage) in (1, 2):
        return f"optimizer=muon is refused under zero_stage={int(x.zero_stage)} with tp={x.tp} (use zero_stage 0 or 3)"
    if work.global_batch % x.dp:
        return f"dp={x.dp} does not divide the global batch of {work.global_batch} samples"
    per_dp, m = work.global_batch // x.dp, microbatches(layout, work)
    if per_dp % m:
        return f"microbatches={m} does not divide the {per_dp} samples per dp rank"
    if x.pp > 1 and schedule_spec(x.pp_schedule).microbatches_rule != "any" and m % x.pp:
        return f"{x.pp_schedule} needs microbatches={m} in whole rounds of pp={x.pp}"
    return ""


def microbatches(layout: Layout, work: Workload) -> int:
    """Microbatches per step of one dp rank (None: one sample each)."""
    return layout.microbatches or work.global_batch // layout.dp


_PIPELINE_ONLY = ("pp_schedule", "pp_virtual_stages", "microbatches")  # the recipe ignores them at pp=1


def recipe_overrides(layout: Layout, work: Workload, gpus_per_node: int) -> list[str]:
    """What to type after ``recipes/train_gpt.py`` to run ``layout`` on ``work``: ``strategy=hybrid3d``, each
    ``strategy.*`` key that differs from the recipe's default (``strategy.dp`` always: its default is ``auto``),
    then always the workload planned for (``precision``, ``model.seq_len``, ``data.global_batch_size``) and the
    processes (``trainer.devices`` per node, ``trainer.num_nodes``).

    The planner's microbatches (None: one sample each) become ``strategy.microbatches`` under pp (left out where
    they equal the recipe's 2 x pp) and ``trainer.accumulate_grad_batches`` at pp=1; a registered sharding variant
    is ``strategy.sharding.name``; ``overlap_grad_reduce`` is left out under ZeRO-3 (FSDP2 overlaps by itself)."""
    values = {name: getattr(layout, name) for name in ParallelConfig.names() if hasattr(layout, name)}
    m = microbatches(layout, work)
    values["microbatches"] = m if m != 2 * layout.pp else None
    if layout.zero_stage == 3:
        values["overlap_grad_reduce"] = False
    if sharding := getattr(layout.zero_stage, "sharding", None):  # a PlannedStage: the variant by its name
        values["zero_stage"], values["sharding"] = 0, sharding
    if layout.pp == 1:
        values.update({name: getattr(ParallelConfig, name) for name in _PIPELINE_ONLY})
    default = ParallelConfig()
    out = ["strategy=hybrid3d", f"strategy.dp={layout.dp}"]
    set_ = {k: v for k, v in values.items() if k != "dp" and v != getattr(default, k)}
    out += [f"strategy.{recipe_key(k)}={_value(v)}" for k, v in set_.items()]
    out += [f"precision={work.precision}", f"model.seq_len={work.seq_len}"]
    if work.fsdp_float8_all_gather and layout.zero_stage == 3:
        out.append("precision.fsdp_float8_all_gather=true")
    if work.optimizer != "adamw":
        out.append(f"optimizer={work.optimizer}")
    out.append(f"data.global_batch_size={work.global_batch}")
    if layout.pp == 1 and m > 1:
        out.append(f"trainer.accumulate_grad_batches={m}")
    devices = min(gpus_per_node, layout.world)
    return [*out, f"trainer.devices={devices}", f"trainer.num_nodes={layout.world // devices}"]


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
