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
from test_fp8_parity import batch, check

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


def llama_runs(tmp_path_factory, layouts: dict, references: dict, tag: str) -> Batch:
    """The ``layouts`` and their references (tests/test_fp8_parity.py's ``batch``) on a two-layer Llama written to a
    folder of its own (save_pretrained, weights drawn after seed 0)."""
    folder = tmp_path_factory.mktemp(f"{tag}_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return batch(tmp_path_factory, layouts, tag, references, worker="hf", path=str(folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    return llama_runs(tmp_path_factory, LAYOUTS, REFERENCES, "fp8hf")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_hf_llama_parity(runs, label):
    world, spec, tp, _, _ = LAYOUTS[label]
    dp = world // tp // (2 if "pp=2" in spec else 1)
    leaders = [d * tp for d in range(dp)]  # one rank per tp group (its ranks see the same batch); pp: the first stage
    check(runs, label, LAYOUTS, "llama", leaders, pairs=False)  # the hf worker records one loss per step
