"""One benchmark launch: a recipe's model and data (composed from conf/ like the recipe does) trained for a
few steps under one strategy; each rank writes ``rank<N>.json`` with its step times, model-state bytes and,
when asked, the bytes it communicated in one step and the pipeline timeline.

Started by benchmarks/bench.py on N processes with torchrun's environment (Lightning launches nothing).

Strategy specs: ``ddp`` (Lightning's), ``model_parallel`` / ``model_parallel:tp=2`` (Lightning's
ModelParallelStrategy, the models parallelized in configure_model as benchmarks/baselines.py shows),
``zero1``..``zero3`` and ``hybrid3d:dp=2,tp=2,pp_schedule=gpipe,...`` (ours); ``true``/``false`` are booleans
(``zero1:overlap_grad_reduce=true``, ``hybrid3d:compile=true``). ``ddp:compile=true`` is Lightning's DDP with
the same layers compiled as our ``compile=True`` compiles (each pipeline layer's forward, in configure_model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import ModelParallelGPT, ModelParallelVGG  # noqa: E402
from host_counts import HostCounts, HostSyncs  # noqa: E402
from muon_bytes import OptimizerStepBytes  # noqa: E402

from lightning_parallel import Hybrid3DStrategy, ZeroStrategy  # noqa: E402
from lightning_parallel.callbacks.activation import ActivationMemoryMonitor  # noqa: E402
from lightning_parallel.callbacks.moe import MoEAuxLossScale, MoEMonitor  # noqa: E402
from lightning_parallel.callbacks.monitor import TrainingMonitor  # noqa: E402
from lightning_parallel.callbacks.preemption import Preemption  # noqa: E402
from lightning_parallel.callbacks.resume import ExactResume  # noqa: E402
from lightning_parallel.models import GPTModule, LitVGG  # noqa: E402
from lightning_parallel.models.gpt import RecipeGPT  # noqa: E402
from lightning_parallel.models.vgg import VGG  # noqa: E402
from lightning_parallel.parallel.dtensor import local  # noqa: E402
from lightning_parallel.parallel.expert.moe import moe_layers  # noqa: E402
from lightning_parallel.parallel.measure.memory import model_state_bytes  # noqa: E402
from lightning_parallel.parallel.parallelize import compile_layers  # noqa: E402
from lightning_parallel.parallel.shutdown import release_process_groups
from lightning_parallel.plugins.precision import cpu_fp16_plugin  # noqa: E402
from lightning_parallel.recipes.config import register_configs  # noqa: E402
from lightning_parallel.recipes.gpt import TextData, gpt_config  # noqa: E402
from lightning_parallel.recipes.metrics import parameter_counts  # noqa: E402
from lightning_parallel.recipes.model_kinds import kind_of  # noqa: E402
from lightning_parallel.recipes.optimizers import use_optimizer  # noqa: E402
from lightning_parallel.recipes.vgg import ImageData, scaled_lr, vgg_config  # noqa: E402
from lightning_parallel.strategies.base import MeshStrategy  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL_KEYS = ("seq_len", "d_model", "n_layer", "vocab_size", "moe_experts", "moe_top_k", "moe_hidden", "moe_every")


def _value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_spec(spec: str, world: int) -> tuple[Any, dict[str, int]]:
    """The strategy for ``spec`` and its (dp, pp, tp, ...) degrees (cp ranks share their samples: not in dp)."""
    name, _, args = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, args.split(",")):
        key, value = item.split("=")
        kwargs[key] = _value(value)
    if name == "ddp":
        return "ddp", {"dp": world, "pp": 1, "tp": 1, "compile": kwargs.get("compile", False)}
    if name == "model_parallel":
        tp = kwargs.get("tp", 1)
        return ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp), {
            "dp": world // tp,
            "pp": 1,
            "tp": tp,
        }
    if name.startswith("zero"):
        return ZeroStrategy(stage=int(name[4]), **kwargs), {"dp": world, "pp": 1, "tp": 1}
    if name == "hybrid3d":
        pp, tp, ep, cp = kwargs.get("pp", 1), kwargs.get("tp", 1), kwargs.get("ep", 1), kwargs.get("cp", 1)
        cp *= kwargs.get("spatial", 1)  # spatial strips take the cp axis: their ranks share samples too
        return Hybrid3DStrategy(**kwargs), {"dp": world // (pp * tp * cp), "pp": pp, "tp": tp, "ep": ep, "cp": cp}
    raise ValueError(f"unknown benchmark strategy spec {spec!r}")


class StepTimer(pl.Callback):
    """Wall time of every training batch on this rank (forward, backward, optimizer step), and the main thread's CPU
    time in it (what other processes' load on the host changes least: waits and preemption do not count)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.thread_time() - self._cpu)


class StepPhases(pl.Callback):
    """Where a training batch's wall time goes on this rank, by Lightning's hooks: forward (batch start to
    on_before_backward: zero_grad, the training step, ZeRO-3's gathers), backward (to on_after_backward: DDP's
    overlapped all-reduce included), reduce (to on_before_optimizer_step: our reduction after backward, tied weights,
    clipping, fp16 unscaling), step (to batch end: optimizer.step, ZeRO-1/2's parameter gather). Pipelined steps
    run their schedule inside the training step: all of it counts as forward there."""

    PHASES = ("forward", "backward", "reduce", "step")

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def _mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._marks: dict[str, float] = {}
        self._mark("start")

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._marks.setdefault("before_backward", time.perf_counter())

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark("after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark("before_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark("end")
        order = ["start", "before_backward", "after_backward", "before_step", "end"]
        if all(k in self._marks for k in order):
            times = [self._marks[k] for k in order]
            self.steps.append({name: b - a for name, a, b in zip(self.PHASES, times, times[1:])})

    def medians(self, skip: int) -> dict[str, float]:
        steps = self.steps[skip:-2] or self.steps
        return {name: median(s[name] for s in steps) for name in self.PHASES} if steps else {}


class ModelStates(pl.Callback):
    """Model-state bytes after the last optimizer step, before the next zero_grad."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step < trainer.max_steps:
            return  # the last step's only: counting every step's bytes would be host work inside the timed steps
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.bytes = model_state_bytes(trainer.strategy.model, opts)


class CompiledGPT(GPTModule):
    """LitGPT whose pipeline layers run their forward through ``torch.compile``, as ``compile=True`` does under
    our strategies (the same function): the compiled baseline for Lightning's ``ddp``."""

    def configure_model(self) -> None:
        super().configure_model()
        compile_layers(self)


def build_model(recipe: str, cfg: Any, lightning_2d: bool, compiled: bool = False) -> pl.LightningModule:
    m = cfg.model
    if recipe == "gpt" and kind_of(m).name != "gpt":  # model=hf*, with peft=lora its adapters: as the recipe's workers
        return kind_of(m).build(cfg)
    if recipe == "gpt":
        cls = ModelParallelGPT if lightning_2d else CompiledGPT if compiled else GPTModule
        model = cls(gpt_config(m), lr=m.lr, weight_decay=m.weight_decay, build_in_configure_model=True)
        if cfg.optimizer.name != "adamw":  # optimizer=sgd|muon: the recipe's (adamw: the model's own, the same AdamW)
            use_optimizer(model, cfg)
        return model
    cls = ModelParallelVGG if lightning_2d else LitVGG
    return cls(
        vgg_config(m), optimizer=m.optimizer, lr=scaled_lr(cfg), momentum=m.momentum, build_in_configure_model=True
    )


def expert_param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the expert weights this rank holds (its E/ep experts of every MoE layer; 0 without MoE)."""
    return sum(
        local(p).numel() * local(p).element_size() for m in moe_layers(module).values() for p in m.experts.parameters()
    )


def num_params(recipe: str, cfg: Any) -> int:
    """Parameters of the whole model (a tied weight once), built on the meta device."""
    with torch.device("meta"):
        model = RecipeGPT(gpt_config(cfg.model)) if recipe == "gpt" else VGG(vgg_config(cfg.model))
    return sum(p.numel() for p in model.parameters())


def _precision(value: str, strategy: Any) -> dict[str, Any]:
    """The Trainer's precision. Lightning on a CPU turns ``16-mixed`` into ``bf16-mixed``; given its MixedPrecision
    plugin with torch's GradScaler directly, its own strategies run fp16 as on a GPU (scaler and all), and ours too
    (with their mesh-wide loss scaler: ``cpu_fp16_plugin``)."""
    if value == "16-mixed" and isinstance(strategy, MeshStrategy):
        return {"plugins": [cpu_fp16_plugin(value, "cpu")]}
    if value != "16-mixed" or not isinstance(strategy, str):
        return {"precision": value}
    from lightning.pytorch.plugins import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(device="cpu"))]}


def recipe_callbacks(out: Path) -> list[pl.Callback]:
    """The callbacks the recipes add to every run but async_ps's (recipes/common.py's ``build_trainer``), but the
    TrainingMonitor (the worker has one) and checkpoints (none here)."""
    return [ExactResume(), MoEAuxLossScale(), MoEMonitor(), Preemption(None, marker=None)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=["gpt", "vgg"], required=True)
    parser.add_argument("--overrides", default="[]", help="JSON list of recipe overrides (model=..., data....)")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (compilation)")
    parser.add_argument("--timeline", action="store_true", help="record the last step's pipeline timeline")
    parser.add_argument("--count", type=int, default=0, help="count host work over 3 windows of this many steps")
    parser.add_argument(
        "--syncs", type=int, default=0, help="count host syncs over this many steps, with the recipe's callbacks"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    register_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        overrides = json.loads(args.overrides)
        cfg = compose(f"train_{args.recipe}", overrides=overrides)
    pl.seed_everything(cfg.seed, verbose=False)
    strategy, degrees = parse_spec(args.strategy, world)
    micro = cfg.data.global_batch_size // degrees["dp"]
    model = build_model(args.recipe, cfg, isinstance(strategy, ModelParallelStrategy), degrees.pop("compile", False))
    hf = kind_of(cfg.model).name not in ("gpt", "vgg")  # a library model (model=hf*), built whole
    # model=hf*: trainable (the adapters under peft=lora) and frozen, before the strategy splits it; the native
    # models are built in configure_model: counted on the meta device, all trainable
    counts = parameter_counts(model) if hf else {"trainable_params": num_params(args.recipe, cfg), "frozen_params": 0}
    data = TextData(cfg, micro, cache_dir=args.out.parent / "data") if args.recipe == "gpt" else ImageData(cfg, micro)
    timer, states, phases = StepTimer(), ModelStates(), StepPhases()
    activations = ActivationMemoryMonitor(batch=1)  # a warm-up batch: not timed, before the measured steps
    # the last two steps run under the communication and FLOP counters, then the timeline recorder: not timed
    timeline = args.out / "timeline" if args.timeline else None
    counts_cb = [HostCounts(args.warmup, args.count)] if args.count else []
    monitor = TrainingMonitor(measure_step=args.steps - 2, timeline_dir=timeline)
    # --syncs: the recipe's step as a user runs it (its callbacks, Lightning's progress bar), the counter first
    syncs = HostSyncs(args.warmup, args.syncs) if args.syncs else None
    # an optimizer named in the overrides (benchmarks/muon.py): the measured optimizer step's bytes, counted and
    # by the Muon exchange's formula; its counter nests inside the monitor's, so it comes before it in the list
    named = any(o.startswith("optimizer=") for o in overrides)
    step_bytes = [OptimizerStepBytes(args.steps - 2, args.warmup)] if named else []
    sync_cbs = [syncs, *recipe_callbacks(args.out)] if syncs else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        **_precision(cfg.precision.value, strategy),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bool(syncs),
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # the monitor first: dispatch modes must nest
        callbacks=[*sync_cbs, *step_bytes, monitor, timer, states, activations, phases, *counts_cb],
        use_distributed_sampler=False,
    )
    fit_start = time.perf_counter()
    if os.environ.get("BENCH_PROFILE"):  # where the time goes: rank 0's operator table
        with torch.profiler.profile() as prof:
            trainer.fit(model, datamodule=data)
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (args.out / "profile.txt").write_text(table)
    else:
        trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - fit_start
    result = {
        "rank": rank,
        "world": world,
        "degrees": degrees,
        "step_times": timer.times,
        "warmup": args.warmup,
        # after the warm-up steps (2; more where compiling), before the 2 measured
        "median_step_s": median(timer.times[args.warmup : -2] or timer.times),
        "median_step_cpu_s": median(timer.cpu_times[args.warmup : -2] or timer.cpu_times),  # the same steps'
        "fit_s": fit_s,  # trainer.fit's wall time: setup, every step, teardown
        "host_counts": counts_cb[0].result if counts_cb else {},
        "host_syncs": syncs.result if syncs else {},
        "phases_s": phases.medians(args.warmup),  # the same steps' medians by phase (StepPhases)
        "model_state_bytes": states.bytes,
        "activation_bytes": activations.bytes,  # kept for backward in one training batch on this rank
        "num_params": sum(counts.values()),
        "param_counts": {"trainable": counts["trainable_params"], "frozen": counts["frozen_params"]},
        "micro_batch": micro,
        "model": {k: cfg.model[k] for k in cfg.model if k in MODEL_KEYS},
        "moe_layers": list(moe_layers(trainer.strategy.model)),  # by path, in forward order
        "expert_param_bytes": expert_param_bytes(trainer.strategy.model),
        # the measured step's all-to-alls in issue order (MoE: per-expert counts, dispatch, combine; backward)
        "all_to_all_events": [
            {"payload_bytes": e.payload_bytes, "group_size": e.group_size, "dtype": e.dtype}
            for e in monitor.comm_events
            if e.kind == "all_to_all"
        ],
        "comm_bytes_per_step": monitor.summary.get("comm_bytes_per_step"),
        "comm_bytes_by_axis": monitor.summary.get("comm_bytes_by_axis"),  # mesh axis -> bytes (mesh strategies)
        "comm_sent_bytes_per_step": monitor.summary.get("comm_sent_bytes_per_step"),
        "pipeline_bubble": monitor.summary.get("pipeline_bubble"),
        # overlap_grad_reduce: buckets, and how many the last step launched during backward ({} otherwise)
        "optimizer_step": step_bytes[0].result if step_bytes else {},  # benchmarks/muon_bytes.py
        "overlap": trainer.strategy.sharding.overlap_stats() if hasattr(trainer.strategy, "sharding") else {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    # Lightning's own strategies (the baselines here) leave their process groups to interpreter shutdown, where
    # gloo aborts now and then; ours release them at exit. The same ending for both (parallel/shutdown.py):
    release_process_groups()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
