"""Pipeline parallelism in Fabric: a loop running each micro-batch with ``strategy.pipeline_step`` (every schedule of
the table, pp=2 and pp=2 x tp=2) against the plain Fabric loop in one process (fp32, 10 AdamW steps, clipped and
accumulated: losses within 1e-5, parameters within PARAM_ATOL); pp checkpoints are the same folders as without pp
(a pp=2 save resumed at tp=2 in Fabric and by the Trainer, and the reverse)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_fabric_layouts import _run  # one launch of one run
from test_precision import TOLERANCE

from lightning_parallel import Hybrid3DFabricStrategy
from lightning_parallel.fabric.pipeline import loss_of

CASES = [
    {"name": "plain", "steps": 10},
    {"name": "clip_accumulate", "steps": 10, "clip": 0.05, "accumulate": 2, "meta": True},
]
EPOCH = {"epoch_steps": 5}  # every pass repeats the same 5 batches: a resumed run's 5 steps are steps 5-9


def _chain(tmp: Path, first: str, then: str) -> dict[str, tuple[int, str, list[dict]]]:
    """``first`` trains 5 steps and saves; ``then`` (same world) loads it and trains 5 more."""
    folder = str(tmp / f"{first.replace(':', '_').replace(',', '_').replace('=', '')}_ckpt")
    return {
        f"{first} first": (2, first, [{"name": "first", "steps": 5, "save": folder, **EPOCH}]),
        f"{then} next": (2, then, [{"name": "next", "steps": 5, "load": folder, **EPOCH}]),
    }


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> Batch:
    runs = {
        "reference": (1, "auto", [*CASES, {"name": "ten", "steps": 10, **EPOCH}]),
        "pp2": (2, "hybrid3d:pp=2", CASES),  # 1f1b, 4 microbatches
        **_chain(tmp_path_factory.mktemp("fabric_pp_ckpt"), "hybrid3d:pp=2", "hybrid3d:tp=2"),
    }
    return Batch(tmp_path_factory, runs, tag="fabric_pp", worker="fabric_pp")


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_fabric_pp2_matches_one_process(fast, case):
    run, ref = fast["pp2"], fast["reference"]
    assert_same_losses(run.losses(case), ref.losses(case), f"fabric pp=2 {case}")
    assert_same_params(run.params(case), ref.params(case), f"fabric pp=2 {case}")


def test_fabric_pp_checkpoint_resumes_without_pp(fast):
    """A pp=2 Fabric save (each stage writes its layers under single-process names) loads at tp=2: the next 5
    losses are steps 5-9 of one process training 10 (the tp=2 run also takes pipeline_step's pp=1 path)."""
    ten = fast["reference"].case("ten")["losses"]
    assert_same_losses(fast["hybrid3d:pp=2 first"].losses("first"), ten[:5], "fabric pp=2 first 5 steps")
    assert_same_losses(fast["hybrid3d:tp=2 next"].losses("next"), ten[5:], "fabric pp=2 -> fabric tp=2")


def test_pipeline_step_needs_the_set_up_model():
    strategy = Hybrid3DFabricStrategy(pp=2)
    with pytest.raises(ValueError, match="fabric.setup"):
        strategy.pipeline_step(torch.nn.Linear(2, 2), torch.ones(4, 2), torch.ones(4, 2))


def test_pipeline_settings_refused_as_under_the_trainer():
    """The Trainer's checks of the schedule table, when the Fabric strategy is built (before any process)."""
    with pytest.raises(ValueError, match="at least one microbatch per stage"):
        Hybrid3DFabricStrategy(pp=2, microbatches=1)
    with pytest.raises(ValueError, match="pp_virtual_stages"):
        Hybrid3DFabricStrategy(pp=2, pp_schedule="1f1b", pp_virtual_stages=2)


def test_pipeline_step_without_a_loss_asks_for_loss_fn():
    with pytest.raises(TypeError, match="loss_fn="):
        loss_of(torch.nn.Linear(2, 2), None, "Hybrid3DFabricStrategy")


ACCUMULATED = [CASES[1]]
# fp16 with the loss scaler: clipped; and from a scale of 2**19 the first steps overflow until it has backed off
FP16 = [{"name": "fp16", "steps": 10, "clip": 0.05, "fp16": 1}, {"name": "fp16_backoff", "steps": 6, "fp16": 2**19}]
WIDE = {
    "reference": (1, "auto", [*CASES, *FP16]),
    "zero2_fp16": (2, "zero2", FP16),
    # under pp each microbatch backpropagates its loss times scale / microbatches: it overflows at other scales than
    # one process's whole-batch backward, so the backoff case is the non-pp run's
    "pp2_fp16": (2, "hybrid3d:pp=2", FP16[:1]),
    "gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", ACCUMULATED),
    "interleaved": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", ACCUMULATED),  # 2 stages per rank
    "zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", ACCUMULATED),  # ZB-V, split backward
    "pp2_tp2": (4, "hybrid3d:pp=2,tp=2", CASES),  # 1f1b
    "pp2_tp2_gpipe": (4, "hybrid3d:pp=2,tp=2,pp_schedule=gpipe", ACCUMULATED),
    "pp2_tp2_interleaved": (4, "hybrid3d:pp=2,tp=2,pp_schedule=interleaved_1f1b", ACCUMULATED),
    "pp2_tp2_zero_bubble": (4, "hybrid3d:pp=2,tp=2,pp_schedule=zero_bubble", ACCUMULATED),
    "pp2_dp2_zero1": (4, "hybrid3d:pp=2,dp=2,zero_stage=1", ACCUMULATED),
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Batch:
    return Batch(tmp_path_factory, WIDE, tag="fabric_pp_wide", worker="fabric_pp")


@pytest.mark.slow
@pytest.mark.parametrize("label", [k for k, (_, _, cases) in WIDE.items() if cases is ACCUMULATED or k == "pp2_tp2"])
def test_fabric_pp_schedules_match_one_process(wide, label):
    run, ref = wide[label], wide["reference"]
    for case in wide.runs[label][2]:
        name = case["name"]
        # under tp every rank of a dp index holds the same loss: the mean over all ranks is the dp mean
        assert_same_losses(run.losses(name), ref.losses(name), f"fabric {label} {name}")
        assert_same_params(run.params(name), ref.params(name), f"fabric {label} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("label", ["zero2_fp16", "pp2_fp16"])
def test_fabric_fp16_matches_one_process(wide, label):
    """16-mixed: the losses of one process with torch's GradScaler within fp16's bar, and the same loss scale after
    every step (the same steps skipped on every rank)."""
    run, ref = wide[label], wide["reference"]
    for case in WIDE[label][2]:
        name = case["name"]
        want, got = ref.losses(name), run.losses(name)
        assert all(abs(g - w) <= TOLERANCE["fp16"] * abs(w) for g, w in zip(got, want)), f"{label} {name}: {got}"
        for rank in range(2):
            assert run.case(name, rank)["scales"] == ref.case(name)["scales"], f"{label} {name} rank {rank}"
    assert ref.case("fp16_backoff")["scales"][0] < 2**19  # the overflow path ran


@pytest.mark.slow
def test_fabric_pp_checkpoints_across_front_doors(tmp_path):
    """A Fabric pp=2 save resumed by the Trainer at tp=2; a Trainer pp=2 save loaded by Fabric at pp=2 (zero
    bubble): both next 5 losses are steps 5-9 of one process training 10."""
    want = _run("fabric_pp", 1, "auto", [{"name": "ten", "steps": 10, **EPOCH}], tmp_path / "ref")[0][0]
    want = want["losses"][5:]
    fabric_ckpt, trainer_ckpt = tmp_path / "fabric_ckpt", tmp_path / "trainer_ckpt"
    first = {"name": "first", "steps": 5, **EPOCH}
    _run("fabric_pp", 2, "hybrid3d:pp=2", [{**first, "save": str(fabric_ckpt)}], tmp_path / "f")
    _run("gpt", 2, "hybrid3d:pp=2", [{**first, "save": str(trainer_ckpt)}], tmp_path / "t")
    resumed = {"name": "next", "steps": 5, **EPOCH}
    by_trainer = _run("gpt", 2, "hybrid3d:tp=2", [{**resumed, "resume": str(fabric_ckpt)}], tmp_path / "tr")
    assert_same_losses(by_trainer[0][0]["losses"], want, "fabric pp=2 -> trainer tp=2")
    cases = [{**resumed, "load": str(trainer_ckpt)}]
    by_fabric = _run("fabric_pp", 2, "hybrid3d:pp=2,pp_schedule=zero_bubble", cases, tmp_path / "fr")
    assert_same_losses(by_fabric[0][0]["losses"], want, "trainer pp=2 -> fabric pp=2 zero bubble")
