"""One GPU, one process (NCCL at world 1): our strategies train like Lightning's own single-device run.

Every precision under hybrid3d (dp=1) and ZeRO 1/2/3, ZeRO-2/3 with offload, and ZeRO-3's compiled layers, each against
``strategy="auto"`` on the same GPU, same batch, same seed. ``strategy='zero1'`` refuses one process (it shards
over 2 or more), so ZeRO 1-3 run as ``hybrid3d`` with ``zero_stage`` at dp=1: the same sharding code over a group
of one. All launches start together (fresh interpreters, tests/gpu/gpu_launch.py) and overlap on the GPU.
"""

from __future__ import annotations

import json

import pytest
from gpu_launch import Launch, needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

PRECISIONS = ["32-true", "16-mixed", "bf16-mixed", "bf16-true"]
# clipping in every case: the norm (and, in fp16, the unscale before it) on the device
CASES = [{"name": p, "steps": 8, "precision": p, "clip": 0.05, "validate": p == "32-true"} for p in PRECISIONS]
FP32 = CASES[:1]
# Largest relative loss difference from Lightning's run allowed. Not yet measured on a GPU: the first run's printed
# figures set them (on CPU, the wrong-math failures seen were 9e-3 to 1.9e-2, above every bar here).
TOLERANCE = {"32-true": 1e-4, "16-mixed": 1e-3, "bf16-mixed": 2e-3, "bf16-true": 3e-3}
COMPILED_TOLERANCE = 1e-3  # inductor's fused kernels against eager ones

STRATEGIES = {  # label: (strategy spec, cases)
    "hybrid3d": ("hybrid3d", CASES),
    "zero1": ("hybrid3d:zero_stage=1", CASES),
    "zero2": ("hybrid3d:zero_stage=2", CASES),
    "zero3": ("hybrid3d:zero_stage=3", CASES),
    "zero2-offload": ("hybrid3d:zero_stage=2,offload=1", FP32),
    "zero3-offload": ("hybrid3d:zero_stage=3,offload=1", FP32),
    "zero3-compile": ("hybrid3d:zero_stage=3,compile=1", FP32),
}  # ZeRO-1 compiled at world 1 is gpu-check's mfu_ours (GPT-2 small), beside the plain loop's losses


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Launch]:
    """Lightning's reference and every strategy, started at once."""
    specs = {"reference": ("auto", CASES), **STRATEGIES}
    return {
        label: Launch.start(
            label,
            "run.py",
            1,
            ["gpt", "--strategy", spec, "--cases", json.dumps(cases)],
            tmp_path_factory.mktemp(label),
        )
        for label, (spec, cases) in specs.items()
    }


def _case(launch: Launch, name: str) -> dict:
    (rank0,) = launch.results()
    return next(c for c in rank0 if c["name"] == name)


def _compare(got: dict, want: dict, bar: float, label: str) -> float:
    rel = [abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"])]
    assert len(got["losses"]) == len(want["losses"]) > 0, f"{label}: {len(got['losses'])} losses"
    print(f"{label}: max loss rel diff {max(rel):.1e} (bar {bar:.0e})")
    for step, r in enumerate(rel):
        assert r <= bar, f"{label} step {step}: loss {got['losses'][step]:.6f} vs Lightning {want['losses'][step]:.6f}"
    return max(rel)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", ["hybrid3d", "zero1", "zero2", "zero3"])
def test_same_losses_as_lightning_on_one_gpu(launches, label, precision):
    got, want = _case(launches[label], precision), _case(launches["reference"], precision)
    _compare(got, want, TOLERANCE[precision], f"{label} {precision}")
    if precision == "16-mixed":  # the same loss scales (skipped steps) as torch's GradScaler under Lightning
        assert got["scales"] == want["scales"], f"{label}: loss scales {got['scales']} vs {want['scales']}"
    if got.get("val_loss") is not None:
        assert abs(got["val_loss"] - want["val_loss"]) <= TOLERANCE[precision] * want["val_loss"], label


@pytest.mark.parametrize("label", ["zero2-offload", "zero3-offload"])
def test_offload_on_one_gpu(launches, label):
    """The host-side optimizer states and clipping norms of offload, on a CUDA run."""
    _compare(_case(launches[label], "32-true"), _case(launches["reference"], "32-true"), TOLERANCE["32-true"], label)


@pytest.mark.parametrize("label", ["zero3-compile"])
def test_compiled_layers_on_one_gpu(launches, label):
    got = _case(launches[label], "32-true")
    _compare(got, _case(launches["reference"], "32-true"), COMPILED_TOLERANCE, label)
    assert got["compiled_graphs"] > 0, f"{label}: nothing was compiled"
