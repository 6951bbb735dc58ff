"""precision=fp8 on LitGPT's GPT (a tiny Llama-style config written as a litgpt checkpoint folder; LitGPTCausalLM,
tests/workers/cases/hf.py with library litgpt) under zero2, zero3 (with and without float8 all-gather) and tp=2,
against the same converted model in one process, with the bars of tests/test_fp8_parity.py."""

from __future__ import annotations

import pytest
import torch
from conftest import Batch
from test_fp8_parity import batch, check

litgpt_config = pytest.importorskip("litgpt.config")  # make install installs the litgpt extra
from litgpt.model import GPT  # noqa: E402
from litgpt.utils import save_config  # noqa: E402

CASE = {
    "library": "litgpt",
    "name": "fp8",
    "steps": 10,
    "global_batch": 8,
    "seq_len": 16,
    "lr": 1e-3,
    "precision": "fp8",
}
AG = {**CASE, "name": "fp8_ag", "fp8": {"fsdp_float8_all_gather": True}}
LAYOUTS = {  # label -> (world, strategy, tp, cases, reference)
    "zero2": (2, "zero2", 1, [CASE], "auto"),
    "zero3": (2, "zero3", 1, [CASE, AG], "zero3-one"),
    "tp2": (2, "hybrid3d:tp=2", 2, [CASE], "auto"),
}
REFERENCES = {"auto": ("auto", [CASE]), "zero3-one": ("hybrid3d:zero_stage=3", [CASE, AG])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    torch.manual_seed(0)
    config = litgpt_config.Config(
        name="tiny-llama", block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_embd=32, n_head=4,
        n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=64,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("fp8_litgpt")
    save_config(config, folder)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    return batch(tmp_path_factory, LAYOUTS, "fp8litgpt", REFERENCES, worker="hf", path=str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_fp8_litgpt_parity(runs, label):
    check(runs, label, LAYOUTS, "litgpt", pairs=False)  # the hf worker records one loss per step
