"""Checkpoints with MuonAdamW's state (Muon's momentum buffers, AdamW's moments) resume at another layout: saved after
5 steps at zero2 (flat slices of the momentum) and at tp=2 (DTensor momentum split like its matrix), resumed at
dp2 x tp2 ZeRO-3 (world 4), at zero3 and in one process; the next 2 losses and the parameters after them equal an
uninterrupted one-process run of 7 steps (fp32, ns_dtype=float32)."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_losses, assert_same_params

EPOCH, MORE = 5, 2
MUON = {"optimizer": "muon", "epoch_steps": EPOCH}
SAVES = {"zero2": (2, "zero2"), "tp2": (2, "hybrid3d:tp=2")}
RESUMES = {  # label -> (world, strategy, saved at, loss ranks)
    "zero2 -> dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "zero2", [0, 2]),
    "tp2 -> zero3": (2, "zero3", "tp2", [0, 1]),
    "tp2 -> one process": (1, "hybrid3d", "tp2", [0]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Batch, dict]:
    folder = tmp_path_factory.mktemp("muon_ckpts")
    paths = {label: str(folder / f"{label}.ckpt") for label in SAVES}
    runs = {label: (world, spec, [{"name": "save", "steps": EPOCH, **MUON, "save": paths[label]}])
            for label, (world, spec) in SAVES.items()}  # fmt: skip
    runs["whole"] = (1, "auto", [{"name": "whole", "steps": EPOCH + MORE, **MUON}])  # uninterrupted
    return Batch(tmp_path_factory, runs, tag="muon_save"), paths


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, saved) -> Batch:
    batch, paths = saved
    for label in SAVES:
        batch[label]  # the saves first
    runs = {label: (world, spec, [{"name": "resume", "steps": EPOCH + MORE, **MUON, "resume": paths[at]}])
            for label, (world, spec, at, _) in RESUMES.items()}  # fmt: skip
    return Batch(tmp_path_factory, runs, tag="muon_resume")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RESUMES))
def test_muon_state_resumes_at_another_layout(saved, resumed, label):
    batch, _ = saved
    whole = batch["whole"]
    world, _, at, leaders = RESUMES[label]
    saved_losses = batch[at].losses("save", [0] if "tp2" in at else None)
    assert_same_losses(saved_losses, whole.losses("whole")[:EPOCH], f"{at} before saving")
    got = resumed[label].losses("resume", leaders)
    rel = assert_same_losses(got, whole.losses("whole")[EPOCH:], f"resumed {label}")
    diff = assert_same_params(resumed[label].params("resume"), whole.params("whole"), f"resumed {label}")
    print(f"muon resumed {label}: next losses {got}, rel {rel:.1e}, params {diff:.1e}")
