"""precision=fp8 on a Hugging Face Llama (a tiny config built here; HFCausalLM, tests/workers/cases/hf.py) under
zero2, zero3 (with and without float8 all-gather), tp=2 (with and without sequence parallelism), pp=2, cp=2 and
dp=2 x tp=2 ZeRO-3 (with and without float8 all-gather; the layouts spelled as tests/test_hf_parity.py spells them),
against the same converted model in one process, with
the bars of tests/test_fp8_parity.py (4 x the larger one-process noise: samples reversed, the batch in two
quantized halves). The conversion and the float8 tp styles are the generic ones: nothing HF-specific."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import Batch
from parity import assert_same_losses
from test_fp8_parity import bars, param_distance

CASE = {"name": "fp8", "steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-3, "precision": "fp8"}
AG = {**CASE, "name": "fp8_ag", "fp8": {"fsdp_float8_all_gather": True}}
LAYOUTS = {  # label -> (world, strategy, tp, cases, reference)
    "zero2": (2, "zero2", 1, [CASE], "auto"),
    "zero3": (2, "zero3", 1, [CASE, AG], "zero3-one"),
    "tp2": (2, "hybrid3d:tp=2", 2, [CASE], "auto"),
    "tp2-sp": (2, "hybrid3d:tp=2,sequence_parallel=1", 2, [CASE], "auto"),
    "pp2": (2, "hybrid3d:pp=2", 1, [CASE], "auto"),
    "cp2": (2, "hybrid3d:cp=2", 1, [CASE], "auto"),
    "dp2-tp2-zero3": (4, "hybrid3d:tp=2,zero_stage=3", 2, [CASE, AG], "zero3-one"),
}
REFERENCES = {"auto": ("auto", [CASE]), "zero3-one": ("hybrid3d:zero_stage=3", [CASE, AG])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("fp8_llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)

    def cases(cases: list[dict], **more) -> list[dict]:
        return [{**c, "path": str(folder), **more} for c in cases]

    table = {label: (world, spec, cases(c)) for label, (world, spec, _, c, _) in LAYOUTS.items()}
    for ref, (spec, c) in REFERENCES.items():
        table[ref] = (1, spec, cases(c))
        table[f"{ref}-noise"] = (1, spec, cases(c, flip_batch=True))
        table[f"{ref}-split"] = (1, spec, cases(c, accumulate=2))
    return Batch(tmp_path_factory, table, tag="fp8hf", worker="hf")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_hf_llama_parity(runs, label):
    world, spec, tp, cases, ref = LAYOUTS[label]
    dp = world // tp // (2 if "pp=2" in spec else 1)
    leaders = [d * tp for d in range(dp)]  # one rank per tp group (its ranks see the same batch); pp: the first stage
    for case in cases:
        name = case["name"]
        rtol, ptol = bars(runs, ref, name, pairs=False)  # the hf worker records one loss per step
        got, want = runs[label], runs[ref]
        rel = assert_same_losses(got.losses(name, leaders), want.losses(name), f"llama {label} {name}", rtol)
        diff = param_distance(got.params(name), want.params(name))
        print(f"fp8 llama {label} {name}: loss rel {rel:.1e} (bar {rtol:.1e}), param rms {diff:.1e} (bar {ptol:.1e})")
        assert diff <= ptol, f"llama {label} {name}: parameters {diff:.1e} apart (rms), bar {ptol:.1e}"
    assert got.case(name)["losses"]  # trained
