"""precision=fp8 on Hugging Face Qwen3 (dense, q/k norms), Mixtral and Qwen3-MoE (tiny configs built in the workers as
tests/test_hf_moe_parity.py builds them: HF's load-balancing loss on) under zero2, tp=2 (with sequence parallelism
for Qwen3; the MoE models' routers must see the whole sequence for HF's auxiliary loss) and ep=2, against the same
converted model in one process (the plain Trainer), with the bars of tests/test_fp8_parity.py (4 x the larger
one-process noise: samples reversed, the batch in two quantized halves; for the MoE models the halves' noise is
measured without HF's load-balancing loss, which two halves would change). The experts' grouped multiply runs in
bf16 on the CPU (parallel/float8_experts.py); what converts is checked in tests/test_fp8_moe.py."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import LOSS_RTOL, assert_same_losses
from test_fp8_parity import NOISE_FACTOR, PARAM_RTOL, param_distance
from test_hf_moe_parity import FIELDS

QWEN3 = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # fmt: skip
MODELS = {"qwen3": QWEN3, "mixtral": FIELDS["mixtral"], "qwen3_moe": FIELDS["qwen3_moe"]}
CASE = {"steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-3, "precision": "fp8"}
LAYOUTS = {  # label -> (world, strategy, model, tp)
    "qwen3 zero2": (2, "zero2", "qwen3", 1),
    "qwen3 tp2-sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "qwen3", 2),
    "mixtral zero2": (2, "zero2", "mixtral", 1),
    "mixtral tp2": (2, "hybrid3d:tp=2", "mixtral", 2),
    "mixtral ep2": (2, "hybrid3d:ep=2", "mixtral", 1),
    "qwen3_moe zero2": (2, "zero2", "qwen3_moe", 1),
    "qwen3_moe tp2": (2, "hybrid3d:tp=2", "qwen3_moe", 2),
    "qwen3_moe ep2": (2, "hybrid3d:ep=2", "qwen3_moe", 1),
    # world 4: four data-parallel ranks, the experts split over ep=2 inside them, ZeRO-3
    "mixtral dp4 ep2 zero3": (4, "hybrid3d:ep=2,zero_stage=3", "mixtral", 1),
}
# pp=2 x ep=2 (dp=2 inside each stage) with 2 pipeline microbatches, the model without HF's load-balancing loss
# (under pp each microbatch is a batch of that loss: another loss than one process's), against its own reference
PIPELINE = {"mixtral pp2 ep2 noaux": (4, "hybrid3d:pp=2,ep=2,microbatches=2", "mixtral", 1)}


def case(model: str, **more) -> list[dict]:
    return [{**CASE, "name": model, "config": MODELS[model], **more}]


def without_aux(model: str) -> dict:
    return {**MODELS[model], "output_router_logits": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    """The layouts, and per model the one-process reference and its noise runs: samples reversed, and the batch in
    two quantized halves. HF's load-balancing loss is a product of batch means, so two accumulated halves change
    the loss itself: for the MoE models the halves' noise is measured on the model without it (``-noaux``)."""
    table = {label: (world, spec, case(model)) for label, (world, spec, model, _) in LAYOUTS.items()}
    table.update({label: (w, spec, case(m, config=without_aux(m))) for label, (w, spec, m, _) in PIPELINE.items()})
    for model in MODELS:
        table[f"{model}-one"] = (1, "auto", case(model))
        table[f"{model}-one-noise"] = (1, "auto", case(model, flip_batch=True))
        if model == "qwen3":
            table[f"{model}-one-split"] = (1, "auto", case(model, accumulate=2))
            continue
        table[f"{model}-noaux"] = (1, "auto", case(model, config=without_aux(model)))
        table[f"{model}-noaux-split"] = (1, "auto", case(model, config=without_aux(model), accumulate=2))
    return Batch(tmp_path_factory, table, tag="fp8fam", worker="hf")


def family_bars(runs: Batch, model: str) -> tuple[float, float]:
    """(loss rtol, param rms) as tests/test_fp8_parity.py's ``bars``: NOISE_FACTOR x the larger one-process noise
    (samples reversed; the batch in two halves, for the MoE models without the load-balancing loss)."""
    split = (f"{model}-one-split", f"{model}-one") if model == "qwen3" else (f"{model}-noaux-split", f"{model}-noaux")
    loss_noise, param_noise = 0.0, 0.0
    for other, ref in ((f"{model}-one-noise", f"{model}-one"), split):
        got, want = runs[other], runs[ref]
        loss = max(abs(a - b) / abs(b) for a, b in zip(got.losses(model), want.losses(model)))
        param = param_distance(got.params(model), want.params(model))
        print(f"fp8 {model} one-process {other}: loss rel {loss:.1e}, param rms {param:.1e}")
        loss_noise, param_noise = max(loss_noise, loss), max(param_noise, param)
    return NOISE_FACTOR * max(loss_noise, LOSS_RTOL), NOISE_FACTOR * max(param_noise, PARAM_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_hf_family_parity(runs, label):
    world, spec, model, tp = LAYOUTS[label]
    leaders = list(range(0, world, tp))  # one rank per tp group (its ranks see the same batch)
    rtol, ptol = family_bars(runs, model)
    got, want = runs[label], runs[f"{model}-one"]
    rel = assert_same_losses(got.losses(model, leaders), want.losses(model), f"fp8 {label}", rtol)
    diff = param_distance(got.params(model), want.params(model))
    print(f"fp8 {label}: loss rel {rel:.1e} (bar {rtol:.1e}), param rms {diff:.1e} (bar {ptol:.1e})")
    assert diff <= ptol, f"fp8 {label}: parameters {diff:.1e} apart (rms), bar {ptol:.1e}"
    assert len(got.case(model)["losses"]) == CASE["steps"]
    if "ep2" in label:  # the experts were split: each rank holds E/ep of each layer's
        held = got.case(model)["experts_held"]
        assert held and all("ep" in axes for _, axes in held.values()), held


@pytest.mark.slow
@pytest.mark.parametrize("label", list(PIPELINE))
def test_fp8_hf_moe_pipeline_parity(runs, label):
    world, _, model, _ = PIPELINE[label]
    rtol, ptol = family_bars(runs, model)
    got, want = runs[label], runs[f"{model}-noaux"]
    rel = assert_same_losses(got.losses(model, [0, 1]), want.losses(model), f"fp8 {label}", rtol)
    diff = param_distance(got.params(model), want.params(model))
    print(f"fp8 {label}: loss rel {rel:.1e} (bar {rtol:.1e}), param rms {diff:.1e} (bar {ptol:.1e})")
    assert diff <= ptol, f"fp8 {label}: parameters {diff:.1e} apart (rms), bar {ptol:.1e}"
    held = [axes for rank in range(world) for _, axes in got.case(model, rank)["experts_held"].values()]
    assert held and all("ep" in axes for axes in held), held
