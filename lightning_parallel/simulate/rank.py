"""One rank simulated: the model built on meta, split by the package's ``parallelize()`` on the fake process
group, then a few real training steps on fake tensors, the step the strategies run (forward and loss, backward,
the sharding's gradient reduction, clipping by the whole model's norm, the optimizer step), measured.

The order is torch's for fake tensors (torchtitan's dry run): modules built outside the fake mode (on meta), split
and stepped inside it, so every tensor a rank would hold has a shape, a dtype and a size, and none has memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim import Optimizer

from lightning_parallel._compat import fake_tensor_mode, mem_tracker
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.measure.flops import LocalFlopCounter
from lightning_parallel.parallel.parallelize import Parallelized, parallelize
from lightning_parallel.parallel.step import clip_model_grad_norm, reduce_step_gradients
from lightning_parallel.simulate.experts import uniform_routing
from lightning_parallel.simulate.model import Batch, SimulatedModel, fake_materialize
from lightning_parallel.simulate.pipeline import (
    FirstStage,
    SimulatedPipeline,
    settle_tied,
    simulated_pipeline,
    static_shapes,
)
from lightning_parallel.simulate.scaling import (
    MicrobatchTags,
    held_per_microbatch,
    reduced_microbatches,
    scale_step,
)
from lightning_parallel.simulate.trace import Collective, TraceRecorder
from lightning_parallel.simulate.world import SimulatedWorld, rank_coordinates
from lightning_parallel.strategies.runtime import keep_logits_split

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


@dataclass
class RankResult:
    """What one simulated rank holds, sends and computes in a step (the last one simulated).

    Attributes:
        rank: its global rank; coordinates: its index along every mesh axis.
        model_state_bytes: ``params``, ``grads``, ``optimizer``, ``total`` from the sharded tensors after a step
            (before zero_grad), each storage once, as ``metrics.json`` reports them.
        peak_bytes: torch's MemTracker peak over the steps (model states, activations, temporaries); by_kind: that
            peak's split (``Parameter``, ``Gradient``, ``Activation``, ``Temp``, ``Optimstate``, ``Buffer``).
        activation_bytes: what the forward leaves for backward, at its end (MemTracker's activations and
            temporaries then, the largest over the steps): the planner's activation figure.
        flops: counted on this rank's local shards, one step.
        collectives: every op of the last step, in issue order.
        trace: every op of every step (for the consistency check).
        seconds: wall time of the simulation of this rank.
        stages: the pipeline stages it holds (empty without pp).
        first_stage: what ranks of later stages learn from it, when it holds the first pipeline stage.
        microbatches_run: under pp, the microbatches the rank ran when its step was extended from a shorter one
            (:mod:`~lightning_parallel.simulate.scaling`: ``collectives`` then lists each distinct op once with its
            ``count``, ``flops`` the extended step's); None when it ran the configured count.
        microbatches_agree: with ``microbatches_run``, whether every middle microbatch issued the same ops.
    """

    rank: int
    coordinates: dict[str, int]
    model_state_bytes: dict[str, int]
    peak_bytes: int
    by_kind: dict[str, int]
    activation_bytes: int
    flops: int
    collectives: list[Collective]
    trace: list[Collective] = field(repr=False, default_factory=list)
    seconds: float = 0.0
    stages: list[int] = field(default_factory=list)
    first_stage: FirstStage | None = None
    microbatches_run: int | None = None
    microbatches_agree: bool = True


def state_bytes(module: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """``parallel/measure/memory.py``'s ``model_state_bytes`` on tensors that may be fake: storages told apart by
    identity, not by address (fake storages have none)."""
    params = [*module.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    seen: set[int] = set()

    def count(tensors: list[Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = local(t).untyped_storage()
            key = StorageWeakRef(storage).cdata
            if key not in seen and storage.nbytes():
                seen.add(key)
                total += storage.nbytes()
        return total

    p = count(params)
    g = count([q.grad for q in params if q.grad is not None])
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    o = count(states)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def simulate_rank(
    world: SimulatedWorld,
    config: ParallelConfig,
    model: SimulatedModel,
    samples: int,
    precision: str = "bf16-mixed",
    steps: int = 2,
    clip: float | None = 1.0,
    first_stage: FirstStage | None = None,
    scale_schedule: bool = True,
) -> RankResult:
    """Split ``model`` as ``config`` says on ``world``'s rank and run ``steps`` training steps of ``samples``
    samples (this rank's share of the global batch) on fake tensors; under pp, ``first_stage`` is what a rank of the
    first stage passes on (:func:`first_stage_of`), needed unless this rank holds the first stage. With
    ``scale_schedule``, a 1F1B or interleaved step of more than ``2 * pp`` microbatches runs ``2 * pp`` of them (of
    the real size) and its collectives and FLOPs are extended to the configured count
    (:mod:`~lightning_parallel.simulate.scaling`)."""
    with warnings.catch_warnings():
        # ZeRO-1/2's flat buffers compare storage addresses, which fake tensors warn about (and do not have)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # under pp, torch's note for each tp plan entry of a layer another stage holds (a real run's too)
        warnings.filterwarnings("ignore", message="Parallelize plan key .* could not be resolved")
        reduced = reduced_microbatches(config) if scale_schedule else None
        if reduced is None:
            return _simulate_rank(world, config, model, samples, precision, steps, clip, first_stage)
        assert config.microbatches is not None
        short = dataclasses.replace(config, microbatches=reduced)
        per = samples // config.microbatches
        result = _simulate_rank(world, short, model, per * reduced, precision, steps, clip, first_stage, True)
        ops, result.flops, more, agree = scale_step(*result.collectives, config.microbatches, reduced)
        result.collectives, result.microbatches_run, result.microbatches_agree = ops, reduced, agree
        result.activation_bytes += more  # torch's receive buffers and the batch, for every microbatch of the step
        result.peak_bytes += more
        result.by_kind["Activation"] = result.by_kind.get("Activation", 0) + more
        return result


def first_stage_of(
    world: SimulatedWorld, config: ParallelConfig, model: SimulatedModel, samples: int, precision: str
) -> FirstStage:
    """What ranks of later stages learn from ``world``'s rank (one that holds the first pipeline stage): its
    outputs on one microbatch and its tied weights, split and run on fake tensors as :func:`simulate_rank` would."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        warnings.filterwarnings("ignore", message="Parallelize plan key .* could not be resolved")
        module, parallel, fake = _split(world, config, model, precision)
        with fake, _routing(world):
            boundary = _stage_shapes(world, config, parallel, model, samples, precision, None)[1]
            return FirstStage(boundary, parallel.tied.local_entries() if parallel.tied is not None else None)


def _simulate_rank(
    world: SimulatedWorld,
    config: ParallelConfig,
    model: SimulatedModel,
    samples: int,
    precision: str,
    steps: int,
    clip: float | None,
    first_stage: FirstStage | None,
    tagged: bool = False,
) -> RankResult:
    """The rank's steps; with ``tagged``, ``collectives`` is (the last step's ops, their microbatches, the FLOPs
    by microbatch, the bytes held per microbatch) for :func:`~lightning_parallel.simulate.scaling.scale_step`."""
    start = time.perf_counter()
    module, parallel, fake = _split(world, config, model, precision)
    with fake, _routing(world):
        optimizer = _optimizer(module)
        world.sharding.shard_optimizer(optimizer)
        tracker, recorder, activations = mem_tracker(), TraceRecorder(), [0]
        tags = MicrobatchTags(recorder) if tagged else None

        def sample() -> None:  # at the end of the forward (of each microbatch's under pp), before backward
            now = _snapshot(tracker, "current")
            activations.append(now.get("Activation", 0) + now.get("Temp", 0))

        pipeline = None
        if parallel.split is not None:
            pipeline, first_stage = _pipeline(world, config, parallel, module, model, samples, precision, first_stage)
            pipeline.forward_start, pipeline.forward_done = lambda stage: _forget(tracker, stage), sample
            pipeline.tags = tags
        tracker.track_external(module, optimizer)
        with tracker:
            for step in range(steps):
                recorder.step = step
                tracker.reset_mod_stats()  # module stats per step; the peak stays
                counted = LocalFlopCounter()
                if tags is not None:
                    tags.begin_step(counted)
                batch = model.make_batch(samples)
                with recorder, counted:
                    _train_step(world, parallel, module, optimizer, batch, precision, clip, sample, pipeline)
                if tags is not None:
                    tags.end_step()
                flops = counted.flops  # the last step's
                states = state_bytes(module, optimizer)  # after the step, before zero_grad (metrics.json's moment)
                optimizer.zero_grad(set_to_none=True)
        peak = _snapshot(tracker, "peak")
    trace = recorder.collectives(world.groups())
    last: Any = [c for c in trace if c.step == steps - 1]
    if tags is not None:
        assert pipeline is not None
        held = held_per_microbatch([s for ss in pipeline._stages.values() for s in ss], batch, config.microbatches)
        last = (last, [t for c, t in zip(trace, recorder.tags) if c.step == steps - 1], tags.flops, held)
    return RankResult(
        rank=world.rank,
        coordinates=rank_coordinates(world.dims, world.rank),
        model_state_bytes=states,
        peak_bytes=peak.get("Total", 0),
        by_kind={k: v for k, v in peak.items() if k != "Total"},
        activation_bytes=max(activations),
        flops=flops,
        collectives=last,
        trace=trace,
        seconds=time.perf_counter() - start,
        stages=sorted(parallel.split.stages) if parallel.split is not None else [],
        first_stage=first_stage if parallel.split is not None and 0 in parallel.split.stages else None,
    )


_CPU = torch.device("cpu")


def _pipeline(
    world: SimulatedWorld,
    config: ParallelConfig,
    parallel: Parallelized,
    module: Any,
    model: SimulatedModel,
    samples: int,
    precision: str,
    first_stage: FirstStage | None,
) -> tuple[SimulatedPipeline, FirstStage | None]:
    """This rank's stages under the schedule, given static shapes (inside the fake mode, before any step); what
    it passes on to ranks of later stages when it holds the first one (else ``first_stage`` back)."""
    assert parallel.split is not None
    given = first_stage.boundary if first_stage is not None else None
    shapes, boundary = _stage_shapes(world, config, parallel, model, samples, precision, given)
    if parallel.tied is not None:
        settle_tied(parallel.tied, module, parallel.split, first_stage)
    if 0 in parallel.split.stages:
        first_stage = FirstStage(boundary, parallel.tied.local_entries() if parallel.tied is not None else None)
    group, tp = world.mesh.group("stage"), world.dims.tp > 1
    made = simulated_pipeline(
        parallel.split, config.pp_schedule, config.microbatches, group, _CPU, module.loss, shapes, tp
    )
    return made, first_stage


def _split(world: SimulatedWorld, config: ParallelConfig, model: SimulatedModel, precision: str) -> tuple:
    """The model split on ``world``'s rank, its pieces fake (built outside the fake mode, split inside it); the
    module, what ``parallelize()`` did, the fake mode."""
    module = model.module
    if precision == "bf16-true":
        module.to(torch.bfloat16)  # Lightning's HalfPrecision.convert_module, before the split
    fake = fake_tensor_mode(allow_non_fake_inputs=True)
    with fake_materialize(module, fake):
        parallel = parallelize(module, module, world.mesh, config, world.sharding, _CPU, info=_quiet)
    # as the front doors do: logits stay split over the vocabulary (under pp the schedule runs in one loss_parallel
    # instead: simulate/pipeline.py)
    keep_logits_split(module, parallel, world.dims.tp)
    return module, parallel, fake


def _forget(tracker: Any, stage: nn.Module) -> None:
    """Drop ``MemTracker``'s statistics of ``stage``'s modules (before its next microbatch's forward: torch's
    tracker takes a root module called again for a new step); the other stages' stay for their backwards."""
    for module in stage.modules():
        tracker.memory_tracking.pop(module, None)


def _routing(world: SimulatedWorld) -> Any:
    return uniform_routing() if world.dims.ep > 1 else contextlib.nullcontext()


def _autocast(precision: str) -> Any:
    dtype = AUTOCAST.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _stage_shapes(
    world: SimulatedWorld,
    config: ParallelConfig,
    parallel: Parallelized,
    model: SimulatedModel,
    samples: int,
    precision: str,
    boundary: Any,
) -> tuple[dict[int, dict[str, Any]], Any]:
    """:func:`~lightning_parallel.simulate.pipeline.static_shapes` of this rank's stages, on one microbatch of this
    rank's piece of a batch (inside the fake mode)."""
    assert parallel.split is not None and config.microbatches
    inputs, targets = model.make_batch(samples)
    if parallel.splits_samples:  # cp: this rank's chunks of every sequence
        inputs, targets = (parallel.shard_batch((inputs[0], targets))[0],), targets
    microbatch = tuple(t[: samples // config.microbatches] for t in inputs)
    return static_shapes(parallel.split, microbatch, boundary, _CPU, lambda: _autocast(precision))


def _quiet(message: str) -> None:
    """parallelize()'s notes on what it chose (the strategies print them on rank 0): left out of the report."""


def _optimizer(module: Any) -> Optimizer:
    """The module's own optimizer (``configure_optimizers``: an optimizer, or Lightning's dict or lists)."""
    made = module.configure_optimizers()
    if isinstance(made, dict):
        made = made["optimizer"]
    if isinstance(made, (list, tuple)):
        made = made[0][0] if isinstance(made[0], (list, tuple)) else made[0]
    return made


def _train_step(
    world: SimulatedWorld,
    parallel: Parallelized,
    module: Any,
    optimizer: Optimizer,
    batch: Batch,
    precision: str,
    clip: float | None,
    forward_done: Any = None,
    pipeline: SimulatedPipeline | None = None,
) -> None:
    """One optimizer step as the strategies run it (``MeshStrategy.optimizer_step``, Fabric's loop; under pp
    Fabric's ``pipeline_step``: the schedule's forwards and backwards in one ``loss_parallel`` under tp)."""
    sharding = world.sharding
    if parallel.splits_samples:  # cp: this rank's chunks of every sequence
        inputs, targets = parallel.shard_batch((batch[0][0], batch[1]))
        batch = (inputs,), targets
    sharding.before_last_backward(optimizer)
    tp = loss_parallel() if world.dims.tp > 1 else contextlib.nullcontext()
    if pipeline is not None:
        with tp, _autocast(precision):
            pipeline.train_step(batch[0], {}, batch[1])
    else:
        with _autocast(precision):
            loss = module.loss(module(*batch[0]), batch[1])
        if forward_done is not None:
            forward_done()
        with tp:
            loss.backward()
    reduce_step_gradients(parallel, sharding, optimizer)
    if clip is not None:
        clip_model_grad_norm(optimizer, clip, 2.0, parallel, sharding, world.mesh)
    optimizer.step()
    sharding.after_step(optimizer)


def _snapshot(tracker: Any, which: str) -> dict[str, int]:
    """MemTracker's ``peak`` or ``current`` snapshot, summed over devices, by kind of tensor."""
    out: dict[str, int] = {}
    for stats in tracker.get_tracker_snapshot(which).values():
        for kind, value in stats.items():
            name = getattr(kind, "value", str(kind))
            out[name] = out.get(name, 0) + int(value)
    return out
