"""``simulate()``: a layout checked at its real world size from the code that will run it, rank by rank, each in a
fresh child process (:mod:`.rank`), then the ranks' collectives compared group by group (:mod:`.trace`) and each
rank's step timed on the planner's cluster model (:mod:`.timing`)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.mesh import MESH_AXES, ParallelDims
from lightning_parallel.planning.cluster import Cluster, get_device
from lightning_parallel.simulate.model import Adapters, build_model
from lightning_parallel.simulate.rank import PRECISIONS, RankResult, first_stage_of, simulate_rank
from lightning_parallel.simulate.timing import StepTime, step_time
from lightning_parallel.simulate.trace import Mismatch, check_consistency
from lightning_parallel.simulate.world import axis_strides, open_rank, rank_coordinates


@dataclass
class Simulation:
    """A layout simulated: one :class:`RankResult` (and its :class:`StepTime`) per simulated rank, the consistency
    of their collectives, what the simulation cost."""

    model: str
    world_size: int
    layout: str
    config: ParallelConfig
    cluster: Cluster
    seq_len: int
    global_batch: int
    precision: str
    ranks: list[RankResult]
    times: list[StepTime]
    mismatches: list[Mismatch] = field(default_factory=list)
    groups_compared: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    adapters: Adapters = field(default_factory=Adapters)

    def config_degree(self, axis: str) -> int:
        return self.config.dims(self.world_size).degrees[axis]

    def to_dict(self) -> dict[str, Any]:
        """What ``--json`` prints: one entry per simulated rank."""
        return {
            "model": self.model,
            "world_size": self.world_size,
            "layout": self.layout,
            "device": self.cluster.device.name,
            "gpus_per_node": self.cluster.gpus_per_node,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch,
            "precision": self.precision,
            "lora_rank": self.adapters.rank,
            "lora_base_dtype": self.adapters.base_dtype,
            "ranks": [_rank_dict(r, t) for r, t in zip(self.ranks, self.times)],
            "consistent": not self.mismatches,
            "groups_compared": self.groups_compared,
            "mismatches": [m.describe() for m in self.mismatches],
            "simulation_seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def _rank_dict(r: RankResult, t: StepTime) -> dict[str, Any]:
    sent: dict[str, float] = {}
    for c in r.collectives:
        sent[c.axes] = sent.get(c.axes, 0.0) + c.sent_bytes * c.count
    return {
        "rank": r.rank,
        "coordinates": r.coordinates,
        "model_state_bytes": r.model_state_bytes,
        "activation_bytes": r.activation_bytes,
        "peak_bytes": r.peak_bytes,
        "peak_by_kind": r.by_kind,
        "flops_per_step": r.flops,
        "comm_sent_bytes_by_axis": sent,
        "pipeline_stages": r.stages,
        "collectives": [c.to_dict() for c in r.collectives],
        "step_time": dataclasses.asdict(t),
        "mfu": t.mfu,
        "simulation_seconds": r.seconds,
        "microbatches_simulated": r.microbatches_run,
        "microbatches_agree": r.microbatches_agree,
    }


def parse_config(layout: ParallelConfig | dict[str, Any] | str | None) -> ParallelConfig:
    """A :class:`ParallelConfig` from one, a dict of its fields, or ``tp=8,pp=4,zero_stage=1`` (its field names)."""
    if isinstance(layout, ParallelConfig):
        return layout.validate()
    if layout is None or isinstance(layout, str):
        layout = _parse_items(layout or "")
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    unknown = sorted(set(layout) - set(names))
    if unknown:
        raise ValueError(f"--layout: {', '.join(unknown)} is no ParallelConfig setting: use among {', '.join(names)}.")
    return ParallelConfig(**layout).validate()


_BOOLS = {"true": True, "false": False}


def _parse_items(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--layout item {item!r}: write name=value, e.g. tp=8,pp=4,zero_stage=1.")
        value = value.strip()
        if value.lower() in _BOOLS:
            out[key.strip()] = _BOOLS[value.lower()]
        elif value.lower() == "none":
            out[key.strip()] = None
        else:
            try:
                out[key.strip()] = int(value)
            except ValueError:
                out[key.strip()] = value
    return out


def default_ranks(dims: ParallelDims) -> list[int]:
    """One rank per distinct position: rank 0, the last rank along each axis of size > 1 (the others at 0: it
    shares that axis's group with rank 0, so their sequences on it are compared), a middle pipeline stage's first
    rank when pp > 2, and the last rank of all (the last pipeline stage, a tp/cp/ep corner)."""
    strides = axis_strides(dims)
    picked = {0, dims.world_size - 1}
    for axis in MESH_AXES:
        if dims.degrees[axis] > 1:
            picked.add((dims.degrees[axis] - 1) * strides[axis])
    if dims.pp > 2:  # a middle pipeline stage: it receives and sends both ways
        picked.add(dims.pp // 2 * strides["pp"])
    return sorted(picked)


def _run_rank(config: ParallelConfig, world: int, rank: int, model: Any, seq: int | None, samples: int, kw: dict):
    """In the child: build, split and step rank ``rank``; its errors come back as plain ones (torch's may not
    pickle), a setting's ValueError or TypeError as itself, anything else with the child's traceback."""
    try:
        built = build_model(model[0], seq, model[1])  # (the source, its adapters)
        with open_rank(config, world, rank, kw["precision"]) as w:
            result = simulate_rank(w, config, built, samples, **kw)
    except (ValueError, TypeError) as err:
        raise type(err)(str(err)) from None
    except Exception:
        raise RuntimeError(f"simulating rank {rank} failed:\n{traceback.format_exc()}") from None
    return result


def _in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh process forked from this one (its own process group, caches and fake tensors)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


def _probe_first_stage(
    config: ParallelConfig, world: int, rank: int, model: Any, seq: int | None, samples: int, precision: str
) -> Any:
    """In the child: what ranks of later stages learn from rank ``rank`` (it holds the first pipeline stage)."""
    try:
        built = build_model(model[0], seq, model[1])  # (the source, its adapters)
        with open_rank(config, world, rank, precision) as w:
            return first_stage_of(w, config, built, samples, precision)
    except (ValueError, TypeError) as err:
        raise type(err)(str(err)) from None
    except Exception:
        failed = traceback.format_exc()
        raise RuntimeError(f"simulating the first pipeline stage (rank {rank}) failed:\n{failed}") from None


def _check_settings(config: ParallelConfig, steps: int, precision: str) -> None:
    if steps < 1:
        raise ValueError(f"--steps={steps}: simulate at least 1 training step.")
    if config.pp > 1 and config.schedule.split_backward:
        raise ValueError(
            f"--layout pp_schedule={config.pp_schedule}: zero-bubble schedules split the backward into "
            "torch.autograd.grad calls, which torch's memory tracker (MemTracker) cannot follow: simulate the layout "
            "with pp_schedule=1f1b or interleaved_1f1b (the same stages, states and messages but the weight-gradient "
            "split) and take the bubble from the planner."
        )
    if precision == "16-mixed":
        raise ValueError(FP16_REFUSED)
    if precision not in PRECISIONS:
        raise ValueError(f"--precision={precision!r}: the simulator runs {', '.join(PRECISIONS)}; choose one of them.")


FP16_REFUSED = (
    "--precision=16-mixed is not simulated: its loss scaler (parallel/loss_scaler.py) reads on the host whether any "
    "rank's gradients overflowed (found_inf.item(), after an all-reduce MAX over the world) to decide whether the "
    "step is taken, and a fake tensor holds no value to read. Simulate --precision bf16-mixed instead: the same "
    "model-state bytes (fp32 parameters, gradients and AdamW states), the same 2-byte activations and the same "
    "collectives, except the scaler's one 4-byte all-reduce over all ranks per step (and fp16's skipped steps)."
)


def _check_batch(config: ParallelConfig, batch: int, batch_ranks: int) -> None:
    if batch % batch_ranks:
        raise ValueError(
            f"--global-batch-size={batch} does not split over the {batch_ranks} data-parallel ranks: give a multiple "
            f"of {batch_ranks}."
        )
    if config.pp > 1 and (batch // batch_ranks) % config.microbatches:
        raise ValueError(
            f"--global-batch-size={batch}: {batch // batch_ranks} samples per data-parallel rank do not split into "
            f"microbatches={config.microbatches}: give a multiple of {batch_ranks * config.microbatches}."
        )


def _simulate_ranks(
    config: ParallelConfig, gpus: int, chosen: list[int], model: Any, seq_len: int | None, samples: int, kw: dict
) -> list[RankResult]:
    """Each chosen rank in a fresh process (its own process group, caches and fake tensors), in order; under pp
    what a rank of the first stage passes on handed to the ranks of later stages (learned first when no chosen
    rank before them holds the first stage)."""
    dims = config.dims(gpus)
    results: list[RankResult] = []
    for rank in chosen:
        if config.pp > 1 and kw.get("first_stage") is None and rank_coordinates(dims, rank)["pp"]:
            stage0 = rank - rank_coordinates(dims, rank)["pp"] * axis_strides(dims)["pp"]
            probe = (config, gpus, stage0, model, seq_len, samples, kw["precision"])
            kw["first_stage"] = _in_child(_probe_first_stage, *probe)
        result = _in_child(_run_rank, config, gpus, rank, model, seq_len, samples, kw)
        kw["first_stage"] = kw.get("first_stage") or result.first_stage
        results.append(result)
    return results


def simulate(
    model: Any,
    gpus: int,
    layout: ParallelConfig | dict[str, Any] | str | None = None,
    *,
    gpus_per_node: int = 8,
    device: str = "h100",
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    precision: str = "bf16-mixed",
    ranks: list[int] | None = None,
    steps: int = 2,
    clip: float | None = 1.0,
    lora_rank: int = 0,
    lora_base_dtype: str | None = None,
    full_schedule: bool = False,
) -> Simulation:
    """Simulate ``layout`` of ``model`` on ``gpus`` devices: the real ``parallelize()`` and training steps at the
    full world size, each chosen rank in a fresh child process on torch's fake process group and fake tensors.

    Args:
        model: a ``conf/model`` name, a Hugging Face config (``config.json``, its folder, a dict or a
            ``PretrainedConfig``), or a LitGPT model name.
        gpus: the world size.
        layout: the parallel settings (:class:`ParallelConfig`, its fields as a dict, or ``"tp=8,pp=4"``);
            ``dp`` defaults to what the other axes leave.
        gpus_per_node, device: the cluster the step time is estimated on (the planner's device table).
        seq_len: tokens per sample (None: the model's context length).
        global_batch_size: samples per optimizer step (None: one per data-parallel rank, or ``microbatches`` of
            them under pp).
        precision: ``32-true``, ``bf16-mixed`` or ``bf16-true``.
        ranks: the global ranks to simulate (None: :func:`default_ranks`).
        steps: training steps per rank (the report shows the last; every one is checked for consistency).
        clip: gradient clipping's max norm (None: no clipping).
        lora_rank: LoRA adapters of this rank on a frozen base (0: every parameter trains), as the planner's
            ``--lora-rank``: peft's adapters on every linear layer but the output head (the recipe's ``peft=lora``),
            Hugging Face models only.
        lora_base_dtype: with ``lora_rank``, the frozen base's dtype (``bfloat16`` or ``float32``; None: as built).
        full_schedule: under pp, run every microbatch; by default a 1F1B or interleaved step of more than ``2 * pp``
            microbatches runs ``2 * pp`` of them, of the real size, and its collectives and FLOPs are extended to the
            configured count (:mod:`~lightning_parallel.simulate.scaling`; activations and peak as measured: the
            microbatches in flight are already those of the longer step).
    """
    start = time.perf_counter()
    config = parse_config(layout)
    dims = config.dims(gpus)
    _check_settings(config, steps, precision)
    cluster = Cluster(gpus, min(gpus_per_node, gpus), get_device(device))
    batch_ranks = dims.role_size("batch")
    per_rank = (config.microbatches or 1) if config.pp > 1 else 1
    batch = global_batch_size or batch_ranks * per_rank
    _check_batch(config, batch, batch_ranks)
    chosen = sorted(set(ranks)) if ranks else default_ranks(dims)
    bad = [r for r in chosen if not 0 <= r < gpus]
    if bad:
        raise ValueError(f"--ranks: {bad} are not ranks of the world of {gpus}: give ranks in 0..{gpus - 1}.")
    # built here once on the meta device: the model's errors come before any rank, and its imports are paid once
    # (each rank's process is forked from this one and builds its own copy)
    adapters = Adapters(lora_rank, lora_base_dtype)
    first = build_model(model, seq_len, adapters)
    kw: dict[str, Any] = {"precision": precision, "steps": steps, "clip": clip, "scale_schedule": not full_schedule}
    results = _simulate_ranks(config, gpus, chosen, (model, adapters), seq_len, batch // batch_ranks, kw)
    bubble = config.schedule.bubble(config.pp, config.microbatches or 1, config.stages_per_rank)
    zero3, hide = config.zero_stage == 3, config.zero_stage == 3 or config.overlap_grad_reduce
    times = [step_time(r.flops, r.collectives, cluster, bubble, zero3, hide) for r in results]
    mismatches, compared = check_consistency({r.rank: r.trace for r in results})
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return Simulation(
        first.name,
        gpus,
        str(dims),
        config,
        cluster,
        first.seq_len,
        batch,
        precision,
        results,
        times,
        mismatches,
        compared,
        time.perf_counter() - start,
        rss,
        adapters,
    )
