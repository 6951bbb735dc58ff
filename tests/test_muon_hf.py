"""MuonAdamW (ns_dtype=float32, fp32, 10 steps, plain and clipped) on a tiny Hugging Face Llama through the generic
HFCausalLM path under zero1, zero2, zero3, HSDP 2 x 2, tp=2 with and without SP, pp=2 (1F1B), dp=2 x tp=2 ZeRO-3
and cp=2 (ring), and on its LoRA adapters (A and B each a matrix for Muon, the frozen base untouched) under zero3,
tp=2 and zero2, against the same optimizer in one process: losses within 1e-5 relative, parameters within 1e-5
(tests/workers/cases/hf.py with optimizer="muon")."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_hf_lora import LORA
from test_hf_parity import CONFIGS

CASE = {"steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-3, "optimizer": "muon"}
CASES = [{**CASE, "name": "plain"}, {**CASE, "name": "clip", "clip": 0.05}]
LORA_CASES = [{**c, "lora": LORA["llama"]} for c in CASES]
LAYOUTS = {  # label -> (world, strategy, LoRA, loss ranks: one per dp x cp index; under pp=2 rank 0 has them)
    "llama zero1": (2, "zero1", False, [0, 1]),
    "llama zero2": (2, "zero2", False, [0, 1]),
    "llama zero3": (2, "zero3", False, [0, 1]),
    "llama hsdp2x2": (4, "hybrid3d:dp_shard=2,zero_stage=3", False, [0, 1, 2, 3]),  # 2 replicas x 2 shards
    "llama tp2": (2, "hybrid3d:tp=2", False, [0]),
    "llama tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", False, [0]),
    "llama pp2 1f1b": (2, "hybrid3d:pp=2", False, [0]),
    "llama pp2 1f1b params": (2, "hybrid3d:pp=2,pp_balance=params", False, [0]),
    "llama dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", False, [0, 2]),
    "llama cp2": (2, "hybrid3d:cp=2", False, [0, 1]),  # ring attention through HF's attention function
    "llama lora zero3": (2, "zero3", True, [0, 1]),
    "llama lora tp2": (2, "hybrid3d:tp=2", True, [0]),
    "llama lora zero2": (2, "zero2", True, [0, 1]),
}
# ranks that hold no Muon matrix: the HF Llama's pipeline layers are embed, the 2 decoder layers, norm and head, and
# pp_balance="uniform" (the default) puts the first 3 on stage 0, so stage 1 steps norm and head with AdamW alone;
# "params" balances parameter counts, one decoder layer per stage
IDLE = {"llama pp2 1f1b": [1]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("muon_llama")
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(folder)

    def cases(lora: bool) -> list[dict]:
        return [{**c, "path": str(folder)} for c in (LORA_CASES if lora else CASES)]

    table = {label: (world, spec, cases(lora)) for label, (world, spec, lora, _) in LAYOUTS.items()}
    table["reference"] = (1, "auto", cases(False))
    table["reference lora"] = (1, "auto", cases(True))
    return Batch(tmp_path_factory, table, tag="muon_hf", worker="hf")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_muon_hf_llama_parity(runs, label):
    world, _, lora, leaders = LAYOUTS[label]
    reference = runs["reference lora" if lora else "reference"]
    for name in ("plain", "clip"):
        rel = assert_same_losses(runs[label].losses(name, leaders), reference.losses(name), f"muon {label} {name}")
        diff = assert_same_params(runs[label].params(name), reference.params(name), f"muon {label} {name}")
        print(f"muon {label} {name}: max loss rel diff {rel:.1e}, max param abs diff {diff:.1e}")
    done = [runs[label].case("plain", r)["muon_exchange"].get("orthogonalized", 0) for r in range(world)]
    want = reference.case("plain")["muon_exchange"]["orthogonalized"]
    # 2 layers x 7 projections; with LoRA their 14 A and 14 B factors instead (the frozen base gets nothing). Once
    # each: under tp=2 a factor replicated beside its split partner gets one owner on the tp mesh too
    assert want == (28 if lora else 14) and sum(done) == want, (label, done, want)
    assert [r for r in range(world) if done[r] == 0] == IDLE.get(label, []), (label, done)  # the others share them
    print(f"muon {label}: matrices orthogonalized per rank {done}")
    if lora:
        plain, clip = reference.params("plain"), reference.params("clip")
        assert all(torch.equal(plain[k], clip[k]) for k in plain if "lora_" not in k)  # the base stayed frozen
        assert any(not torch.equal(plain[k], clip[k]) for k in plain if "lora_B" in k)  # B trained (from zero)
