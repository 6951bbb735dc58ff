"""The profile-guided pipeline split on VGG16 (pp=4): the stages ``pp_balance="profile"`` picks, and the uniform
split's, each re-timed stage by stage apart from the profiler. One process: the question is the split, not
the communication."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.vgg import VGGConfig
from lightning_parallel.parallel.pipeline.partition import uniform_partition
from lightning_parallel.parallel.pipeline.profile import profile_layers, profiled_partition

ROOT = Path(__file__).resolve().parents[1]


def stage_inputs(layers: list[torch.nn.Module], example: torch.Tensor) -> list[torch.Tensor]:
    """The input of every layer when ``example`` runs through all of them."""
    inputs, x = [], example
    with torch.no_grad():
        for layer in layers:
            inputs.append(x)
            x = layer(x)
    return inputs


def retime(layers: list[torch.nn.Module], splits: dict[str, list[range]], example: torch.Tensor, rounds: int = 7):
    """Least forward+backward CPU seconds of every stage, its layers run together on its own input (with an
    input gradient after the first stage, as in the pipeline); whole rounds over every stage of every split,
    so that a change in load slows them alike. Interference only ever adds time: the least is kept."""
    inputs = stage_inputs(layers, example)
    times: dict[tuple[str, range], list[float]] = {(name, r): [] for name, split in splits.items() for r in split}
    for _ in range(rounds + 1):  # the first round warms up
        for (_, stage), seconds in times.items():
            y = inputs[stage.start].detach().requires_grad_(stage.start > 0)
            start = time.process_time()
            for i in stage:
                y = layers[i](y)
            y.sum().backward()
            seconds.append(time.process_time() - start)  # gradients accumulate, as over microbatches
    return {name: [min(times[name, r][1:]) for r in split] for name, split in splits.items()}


def run_pipeline_split(microbatch: int = 8, pp: int = 4) -> dict[str, Any]:
    torch.set_num_threads(1)
    conf = OmegaConf.load(ROOT / "conf/model/vgg16.yaml")
    layers = LitVGG(config=VGGConfig(name=conf.name, width=conf.width)).pipeline_layers()
    example = torch.randn(microbatch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    # CPU seconds of this process, in the profiler and in the re-timing: other processes would set wall time
    split = profiled_partition(profile_layers(layers, example, repeats=3, clock=time.process_time), pp)
    stages = {"profile": split.stages, "uniform": uniform_partition(len(layers), pp)}
    measured = retime(layers, stages, example)
    return {
        "model": "vgg16",
        "pp": pp,
        "microbatch": microbatch,
        "stages": {name: [[r.start, r.stop - 1] for r in split] for name, split in stages.items()},
        "stage_seconds": measured,
        "predicted_seconds": split.stage_seconds,
        "slowest_over_mean": {name: max(t) / statistics.mean(t) for name, t in measured.items()},
    }
