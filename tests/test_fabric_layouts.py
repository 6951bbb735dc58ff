"""Slow tier of the Fabric strategies: the Fabric loop at world 4 (dp x tp, ZeRO-1, ZeRO-3 offload) against one
process and against the Trainer path's losses, and checkpoints across the front doors: a Fabric save resumed by the
Trainer at another layout and the reverse, the next losses equal to one process training on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import PARITY_CASES, Batch
from harness import run_worker
from parity import assert_same_losses, assert_same_params

pytestmark = pytest.mark.slow

CASES = [
    {"name": "plain", "steps": 10},
    {"name": "clip_accumulate", "steps": 10, "clip": 0.05, "accumulate": 2},
]
MOE_CASES = [{**c, "moe": {"moe_experts": 8, "moe_top_k": 2}} for c in CASES]
WIDE = {
    "reference": (1, "auto", CASES),
    "dp2_tp2": (4, "hybrid3d:dp=2,tp=2,zero_stage=1", [{**c, "meta": True} for c in CASES]),
    "sp": (4, "hybrid3d:dp=2,tp=2,sequence_parallel=1", CASES),
    "zero1": (4, "zero1", CASES),
    "zero3_offload": (4, "zero3_offload", CASES),
    "cp2": (4, "hybrid3d:dp=2,cp=2", CASES),  # each sequence in chunks over 2 ranks (strategy.shard_batch)
    "hsdp": (4, "hybrid3d:dp_shard=2,zero_stage=3", CASES),  # ZeRO-3 over 2 ranks, 2 replicas
    "reference_moe": (1, "auto", MOE_CASES),
    "ep2": (4, "hybrid3d:ep=2", MOE_CASES),  # 8 experts, 4 per rank, tokens by all-to-all
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Batch:
    return Batch(tmp_path_factory, WIDE, tag="fabric_wide", worker="fabric")


@pytest.mark.parametrize("label", ["dp2_tp2", "sp", "zero1", "zero3_offload", "cp2", "hsdp", "ep2"])
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_fabric_world4_matches_one_process(wide, label, case):
    run, ref = wide[label], wide["reference_moe" if label == "ep2" else "reference"]
    assert_same_losses(run.losses(case), ref.losses(case), f"fabric {label} {case}")
    assert_same_params(run.params(case), ref.params(case), f"fabric {label} {case}")


def test_fabric_reference_is_the_trainers(wide, reference):
    """The one-process Fabric loop is the Trainer's one-process training: same losses, same parameters."""
    assert PARITY_CASES[0]["name"] == "plain"
    assert_same_losses(wide["reference"].losses("plain"), reference.losses("plain"), "fabric vs trainer")
    assert_same_params(wide["reference"].params("plain"), reference.params("plain"), "fabric vs trainer")


def _run(worker: str, world: int, strategy: str, cases: list[dict], out: Path) -> list[list[dict]]:
    """One launch of one run of a case module (``worker``: "fabric" or "gpt"); each rank's case results."""
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs.json"
    runs.write_text(json.dumps([{"label": "run", "strategy": strategy, "cases": cases}]))
    run_worker(worker, world, ["--runs-file", str(runs)], out)
    return [json.loads((out / "run" / f"rank{r}.json").read_text()) for r in range(world)]


def test_checkpoints_across_front_doors(tmp_path):
    """Fabric (zero3, world 2) saves after 5 steps; the Trainer (hybrid3d tp=2) resumes it, and Fabric (tp=2)
    loads it; the Trainer (zero2) saves after 5 steps and Fabric (hybrid3d dp=2) resumes it. Every pass repeats
    the same 5 batches, so each resumed run's 5 steps are steps 5-9 of one process training 10."""
    epoch = {"epoch_steps": 5}
    ref = _run("fabric", 1, "auto", [{"name": "ten", "steps": 10, **epoch}], tmp_path / "ref")
    want = ref[0][0]["losses"][5:]
    fabric_ckpt, trainer_ckpt = tmp_path / "fabric_ckpt", tmp_path / "trainer_ckpt"
    _run(
        "fabric",
        2,
        "zero3",
        [{"name": "first", "steps": 5, "save": str(fabric_ckpt), **epoch}],
        tmp_path / "f",
    )
    first = {"name": "first", "steps": 5, "save": str(trainer_ckpt), **epoch}
    _run("gpt", 2, "zero2", [first], tmp_path / "t")
    resumed = {"name": "next", "steps": 5, **epoch}
    by_trainer = _run("gpt", 2, "hybrid3d:tp=2", [{**resumed, "resume": str(fabric_ckpt)}], tmp_path / "tr")
    assert_same_losses(by_trainer[0][0]["losses"], want, "fabric zero3 -> trainer tp=2")
    cases = [{**resumed, "name": "from_fabric", "load": str(fabric_ckpt)}]
    by_fabric = _run("fabric", 2, "hybrid3d:tp=2", cases, tmp_path / "fr")
    assert_same_losses(by_fabric[0][0]["losses"], want, "fabric zero3 -> fabric tp=2")
    cases = [{**resumed, "name": "from_trainer", "load": str(trainer_ckpt)}]
    by_fabric = _run("fabric", 2, "hybrid3d", cases, tmp_path / "ft")
    # dp=2: each rank's micro-batch losses, their mean the global loss
    got = [sum(pair) / 2 for pair in zip(by_fabric[0][0]["losses"], by_fabric[1][0]["losses"])]
    assert_same_losses(got, want, "trainer zero2 -> fabric dp=2")
