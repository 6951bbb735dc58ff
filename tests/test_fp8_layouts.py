"""precision=fp8 (torchao float8, emulated) on the recipe GPT under the layouts tests/test_fp8_parity.py leaves out:
HSDP (world 4, dp=4 sharded in pairs: ``dp_shard=2``) with and without float8 all-gather, and pp=2 under every
pipeline schedule beyond 1F1B (parallel/pipeline/schedules.py's table: GPipe, interleaved 1F1B, looped BFS, ZB-V
zero bubble, interleaved zero bubble), each against the same converted model in one process with that module's
bars (4 x the larger one-process perturbation). All slow: world-4 and five world-2 launches."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Batch
from harness import run_worker
from test_fp8_bytes import GATHERS, gathered
from test_fp8_parity import AG, CASE, ZERO3_ONE, batch, check
from workers.cases.common import TINY

from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.parallel.float8 import Float8Settings, convert, converted_weights
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES

HSDP = {  # label -> (world, strategy, tp, cases, reference)
    "hsdp-2x2-zero3": (4, "hybrid3d:dp_shard=2,zero_stage=3", 1, [CASE, AG], "zero3-one"),
}
PIPELINE = {
    f"pp2-{name}": (2, f"hybrid3d:pp=2,pp_schedule={name}", 1, [CASE], "auto") for name in SCHEDULES if name != "1f1b"
}
REFERENCES = {"auto": ("auto", [CASE]), "zero3-one": (ZERO3_ONE, [CASE, AG])}


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory) -> Batch:
    return batch(tmp_path_factory, HSDP, "fp8hsdp", REFERENCES)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> Batch:
    return batch(tmp_path_factory, PIPELINE, "fp8pp", REFERENCES)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(HSDP))
def test_fp8_hsdp_parity(hsdp_runs, label):
    """FSDP2 over the shard axis, replicas over the other: each unit gathers bf16 (or, with float8 all-gather, the
    converted weights in float8 with the whole weight's amax) within its pair, and reduces gradients over all 4."""
    check(hsdp_runs, label, HSDP)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(PIPELINE))
def test_fp8_pipeline_schedule_parity(pipeline_runs, label):
    """Each schedule runs the converted layers' forward and backward per micro-batch (the zero-bubble schedules
    split the backward into input and weight gradients)."""
    check(pipeline_runs, label, PIPELINE)


@pytest.mark.slow
def test_fp8_hsdp_float8_all_gather_bytes(tmp_path_factory):
    """Under HSDP the units gather within a pair (the shard axis, 2 ranks, as ZeRO-3 at world 2): the float8
    all-gather saves one byte per converted weight element per gather (tests/test_fp8_bytes.py's formula)."""
    hsdp = "hybrid3d:dp_shard=2,zero_stage=3"
    specs = [f"{hsdp}+bf16", f"{hsdp}+fp8ag"]
    out = tmp_path_factory.mktemp("fp8_hsdp_bytes")
    counted = run_worker("collectives", 4, ["--opts", json.dumps({"specs": specs})], out, timeout=600)[0]
    bf16, fp8_ag = (gathered(counted[s]["bytes"]) for s in specs)
    model = RecipeGPT(TINY)
    convert(model, Float8Settings(), torch.device("cpu"))
    numel = sum(model.get_parameter(name).numel() for name in converted_weights(model))
    print(f"hsdp 2x2, one step, all-gather bytes: bf16-mixed {bf16}, fp8 + float8 all-gather {fp8_ag} ({numel} fp8)")
    assert fp8_ag == bf16 - GATHERS * numel * (2 - 1)
