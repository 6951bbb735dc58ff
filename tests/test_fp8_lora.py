"""precision=fp8 with LoRA (HFCausalLM(peft_config=...)) on a tiny HF Llama under zero2, tp=2 and zero3 (with and
without float8 all-gather of the frozen base), against the same converted peft model in one process, with the bars
of tests/test_fp8_parity.py. The frozen base Linear layers (peft's ``base_layer``) train in float8 (forward, and the
input gradient in backward); the adapters ``lora_A`` / ``lora_B`` stay high precision by name. Slow: hf launches."""

from __future__ import annotations

import pytest
from conftest import Batch
from test_fp8_hf_parity import CASE as HF_CASE
from test_fp8_hf_parity import llama_runs
from test_fp8_parity import check
from test_hf_lora import LORA

CASE = {**HF_CASE, "name": "fp8_lora", "lora": LORA["llama"]}
AG = {**CASE, "name": "fp8_lora_ag", "fp8": {"fsdp_float8_all_gather": True}}
LAYOUTS = {  # label -> (world, strategy, tp, cases, reference)
    "zero2": (2, "zero2", 1, [CASE], "auto"),
    "tp2": (2, "hybrid3d:tp=2", 2, [CASE], "auto"),
    "zero3": (2, "zero3", 1, [CASE, AG], "zero3-one"),
}
REFERENCES = {"auto": ("auto", [CASE]), "zero3-one": ("hybrid3d:zero_stage=3", [CASE, AG])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    return llama_runs(tmp_path_factory, LAYOUTS, REFERENCES, "fp8lora")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_lora_parity(runs, label):
    check(runs, label, LAYOUTS, "llama lora", pairs=False)  # the hf worker records one loss per step
    for case in LAYOUTS[label][3]:
        result = runs[label].case(case["name"])
        report = result["fp8_report"]
        bases = {p: why for p, why in report.items() if p.endswith(".base_layer")}
        adapters = {p: why for p, why in report.items() if ".lora_" in p}
        assert len(bases) == 7 * 2 and set(bases.values()) == {"float8"}, bases  # 7 targets x 2 layers
        assert adapters and set(adapters.values()) == {"kept by name"}, adapters
        assert result["frozen_with_grad"] == [] and result["frozen_grads_now"] == []  # the float8 base: no gradient
        assert result["trainable_numel"] < result["frozen_numel"]
