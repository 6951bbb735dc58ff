"""precision=fp8 (torchao float8, emulated on the CPU, over bf16-mixed) under every layout against the same
torchao-converted model in one process: the recipe GPT (tests/workers/cases/gpt.py with precision "fp8"), fp32 master
weights, 10 AdamW steps.

Two one-process references, as for bf16-mixed (tests/test_zero_parity.py): layouts that keep fp32 parameters (ZeRO
0-2, tp, pp, cp) against the plain Trainer (``auto``); ZeRO-3 layouts, whose units gather their parameters in bf16
(or, with float8 all-gather, the converted weights in float8 from the fp32 shards) and take bf16 inputs, against
ZeRO-3 in one process (``hybrid3d:zero_stage=3`` at dp=1: FSDP2's same math).

The bar: each one-process reference run again with only the summation order changed (each batch's samples reversed:
the loss's and the weight gradients' sums over tokens in another order), and with the batch quantized in two halves
(two accumulated micro-batches: torchao's dynamic scales are per tensor, so a layout that splits the batch over dp,
pp micro-batches or cp chunks quantizes each rank's activations with that rank's own amax, as torchtitan does: not
only a summation order). A layout must stay within ``NOISE_FACTOR`` times the larger of the two (at least the fp32
loss bar of tests/parity.py). FP8 amplifies such noise: an amax one ulp apart moves elements to the neighbouring
float8 value, and AdamW
turns the changed gradients of coordinates near zero into whole steps of lr (the noise run's largest single-element
difference is 1.2e-3 to 1.4e-3 after 10 steps at lr 1e-3), so parameters are compared per tensor by the root mean
square of the difference (the largest over the tensors), against the same measure of the noise run.
"""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import LOSS_RTOL, assert_same_losses

CASE = {"name": "fp8", "steps": 10, "precision": "fp8"}
AG = {**CASE, "name": "fp8_ag", "fp8": {"fsdp_float8_all_gather": True}}
MOE = {**CASE, "name": "fp8_moe", "moe": {"moe_experts": 4, "moe_top_k": 2}}  # experts: batched weights, kept bf16
NOISE_FACTOR = 4
ZERO3_ONE = "hybrid3d:zero_stage=3"
LAYOUTS = {  # label -> (world, strategy, tp, cases, reference)
    "zero3": (2, "zero3", 1, [CASE, AG], "zero3-one"),
    "zero2": (2, "zero2", 1, [CASE], "auto"),
    "zero1": (2, "zero1", 1, [CASE], "auto"),
    "zero0": (2, "hybrid3d", 1, [CASE], "auto"),
    "tp2-sp": (2, "hybrid3d:tp=2,sequence_parallel=1", 2, [CASE], "auto"),
    "pp2": (2, "hybrid3d:pp=2", 1, [CASE], "auto"),
    "cp2": (2, "hybrid3d:cp=2", 1, [CASE], "auto"),
    "dp2-tp2-zero3": (4, "hybrid3d:tp=2,zero_stage=3", 2, [CASE, AG], "zero3-one"),
    "zero2-ac": (2, "hybrid3d:zero_stage=2,activation_checkpointing=full", 1, [CASE], "auto"),
    "ep2": (2, "hybrid3d:ep=2", 1, [MOE], "auto"),
}
REFERENCES = {"auto": ("auto", [CASE, MOE]), "zero3-one": (ZERO3_ONE, [CASE, AG])}
FAST = "zero3"


# the fast tier's bars, from the noise the slow tier measures (test_fp8_noise_floor keeps them true): ZeRO-3 in one
# process with float8 all-gather, samples reversed, moved the loss by 5.6e-5 and the parameters by 2.1e-4 (rms)
FAST_NOISE = (5.6e-5, 2.1e-4)


def batch(
    tmp_path_factory,
    layouts: dict,
    tag: str,
    references: dict = REFERENCES,
    worker: str = "gpt",
    slow_start: float = 0,
    **more,
) -> Batch:
    """The ``layouts`` (label -> (world, strategy, tp, cases, reference)) and their one-process references, each
    with its two perturbations (``-noise``: samples reversed; ``-split``: the batch in two accumulated halves);
    ``more``: keys added to every case (the hf worker's model folder); ``slow_start``: seconds more per run
    (compiling)."""

    def cases(cases: list[dict], **keys) -> list[dict]:
        return [{**c, **more, **keys} for c in cases]

    table = {label: (world, spec, cases(c)) for label, (world, spec, _, c, _) in layouts.items()}
    for ref in {layout[4] for layout in layouts.values()}:
        spec, ref_cases = references[ref]
        table[ref] = (1, spec, cases(ref_cases))
        table[f"{ref}-noise"] = (1, spec, cases(ref_cases, flip_batch=True))
        table[f"{ref}-split"] = (1, spec, cases(ref_cases, accumulate=2))
    return Batch(tmp_path_factory, table, tag=tag, worker=worker, seconds_per_run=slow_start)


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> Batch:
    """The fast tier's one world-2 run: ZeRO-3 with float8 all-gather, and ZeRO-3 in one process."""
    table = {FAST: (2, "zero3", [AG]), "zero3-one": (1, ZERO3_ONE, [AG])}
    return Batch(tmp_path_factory, table, tag="fp8fast")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    return batch(tmp_path_factory, {k: LAYOUTS[k] for k in CORE}, "fp8")


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory) -> Batch:
    return batch(tmp_path_factory, {k: LAYOUTS[k] for k in ("zero2-ac", "ep2")}, "fp8more")


def bars(runs, ref: str, name: str, pairs: bool = True) -> tuple[float, float]:
    """(loss rtol, param rms): NOISE_FACTOR x the larger one-process noise (samples reversed; the batch in two
    quantized halves; ``pairs``: its losses are per micro-batch), at least the fp32 loss bar."""
    want = runs[ref]
    loss_noise, param_noise = 0.0, 0.0
    for kind in ("noise", "split"):
        other = runs[f"{ref}-{kind}"]
        losses = other.losses(name)
        if kind == "split" and pairs:  # two micro-batches a step: the step's loss is their mean (equal token counts)
            losses = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
        loss = max(abs(a - b) / abs(b) for a, b in zip(losses, want.losses(name)))
        param = param_distance(other.params(name), want.params(name))
        print(f"fp8 {ref} {name} one-process {kind}: loss rel {loss:.1e}, param rms {param:.1e}")
        loss_noise, param_noise = max(loss_noise, loss), max(param_noise, param)
    return NOISE_FACTOR * max(loss_noise, LOSS_RTOL), NOISE_FACTOR * max(param_noise, PARAM_RTOL)


PARAM_RTOL = 1e-6  # the floor of the parameter bar (fp32's)


def param_distance(got: dict, want: dict) -> float:
    """The largest root-mean-square difference over the parameter tensors."""
    assert got.keys() == want.keys(), f"parameter names differ: {set(got) ^ set(want)}"
    return max((got[k].float() - want[k].float()).pow(2).mean().sqrt().item() for k in want)


def check(
    runs, label: str, layouts: dict = LAYOUTS, what: str = "", leaders: list[int] | None = None, pairs: bool = True
) -> None:
    """Each case of ``label`` against its reference, within :func:`bars`; ``what`` names the model in messages;
    ``leaders``: the ranks whose losses average to the step's loss (default: one per tp group); ``pairs``: as
    :func:`bars` (the gpt worker records a loss per micro-batch, the hf worker one per step)."""
    world, _, tp, cases, ref = layouts[label]
    leaders = list(range(0, world, tp)) if leaders is None else leaders
    tag = f"{what} {label}".strip()
    for case in cases:
        name = case["name"]
        rtol, ptol = bars(runs, ref, name, pairs)
        rel = assert_same_losses(runs[label].losses(name, leaders), runs[ref].losses(name), f"{tag} {name}", rtol)
        diff = param_distance(runs[label].params(name), runs[ref].params(name))
        print(f"fp8 {tag} {name}: loss rel {rel:.1e} (bar {rtol:.1e}), param rms {diff:.1e} (bar {ptol:.1e})")
        assert diff <= ptol, f"{tag} {name}: parameters {diff:.1e} apart (rms), bar {ptol:.1e}"
        assert runs[label].case(name)["losses"]  # trained


def test_fp8_parity_fast(fast_runs):
    rtol, ptol = (NOISE_FACTOR * n for n in FAST_NOISE)
    got, want = fast_runs[FAST], fast_runs["zero3-one"]
    rel = assert_same_losses(got.losses("fp8_ag"), want.losses("fp8_ag"), "zero3 fp8_ag", rtol)
    diff = param_distance(got.params("fp8_ag"), want.params("fp8_ag"))
    print(f"fp8 zero3 fp8_ag: loss rel {rel:.1e} (bar {rtol:.1e}), param rms {diff:.1e} (bar {ptol:.1e})")
    assert diff <= ptol, f"zero3 fp8_ag: parameters {diff:.1e} apart (rms), bar {ptol:.1e}"


CORE = [k for k in LAYOUTS if k not in ("zero2-ac", "ep2")]


@pytest.mark.slow
@pytest.mark.parametrize("label", CORE)
def test_fp8_parity(runs, label):
    check(runs, label)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["zero2-ac", "ep2"])
def test_fp8_parity_with_activation_checkpointing_and_experts(more_runs, label):
    """Activation checkpointing recomputes the float8 forward (the same dynamic scales); under ep the MoE experts'
    grouped multiply stays bf16 (batched weights, not Linear layers) and the router high precision by name."""
    check(more_runs, label)


@pytest.mark.slow
def test_fp8_noise_floor(runs):
    """The fast tier's bars stay at least the noise measured here."""
    want, noise = runs["zero3-one"], runs["zero3-one-noise"]
    loss = max(abs(a - b) / abs(b) for a, b in zip(noise.losses("fp8_ag"), want.losses("fp8_ag")))
    params = param_distance(noise.params("fp8_ag"), want.params("fp8_ag"))
    assert loss <= FAST_NOISE[0] * 1.5 and params <= FAST_NOISE[1] * 1.5, (loss, params)
    assert loss > 0 and params > 0  # the reversed samples did change the summation order
