"""A checkpoint saved under pp x tp (+ ZeRO-1) is a sharded folder under single-process names: it resumes
under other pipeline layouts, and in one process once consolidated; a single-process checkpoint file resumes
under a pipeline.

As in test_zero_checkpoint, the reference is Lightning's own single-process save and resume; two steps
after resuming check the weights and the optimizer state.
"""

from __future__ import annotations

import pytest
from conftest import Batch, launch
from parity import assert_same_losses

from lightning_parallel.checkpoint import consolidate

EPOCH = 5
RESUMED_STEPS = 2


def test_pipeline_checkpoint_resumes_in_any_layout(tmp_path, tmp_path_factory):
    base = {"epoch_steps": EPOCH}
    pp_ckpt, plain_ckpt = tmp_path / "pp2_tp2.ckpt", tmp_path / "plain.ckpt"
    # checkpoint_format="full": one file in the single-process format, gathered from both stages
    full_file = tmp_path / "pp2_tp2_full.ckpt"
    saver = "hybrid3d:pp=2,tp=2,zero_stage=1"

    def save(path):
        return [{**base, "name": "save", "steps": EPOCH, "save": str(path)}]

    saves = Batch(
        tmp_path_factory,
        {
            "pp2-tp2": (4, saver, save(pp_ckpt)),
            "pp2-tp2-full": (4, f"{saver},checkpoint_format=full", save(full_file)),
            "plain": (1, "auto", save(plain_ckpt)),
        },
        tag="save",
    )
    assert_same_losses(saves["pp2-tp2"].losses("save", [0]), saves["plain"].losses("save"), "pp=2 x tp=2 before saving")
    assert pp_ckpt.is_dir()  # a sharded folder: every rank wrote its own stage's pieces
    saves["pp2-tp2-full"]  # noqa: B018  (its launch wrote the file)
    assert full_file.is_file()
    one_file = consolidate(pp_ckpt, tmp_path / "pp2_tp2_consolidated.pt")

    def resume(ckpt):
        return [{**base, "name": "resume", "steps": EPOCH + RESUMED_STEPS, "resume": str(ckpt)}]

    layouts = {  # label: (strategy, world, checkpoint, one rank per dp index)
        "auto-consolidated": ("auto", 1, one_file, [0]),  # plain Lightning, from the consolidated file
        "auto-full": ("auto", 1, full_file, [0]),  # plain Lightning, from the gathered file
        "pp4": ("hybrid3d:pp=4,pp_schedule=gpipe", 4, pp_ckpt, [0]),  # other stage cuts
        "pp2-dp2-zero3-zbv": ("hybrid3d:pp=2,dp=2,zero_stage=3,pp_schedule=zero_bubble", 4, pp_ckpt, [0, 1]),
        "pp2-tp2-from-plain": ("hybrid3d:pp=2,tp=2,zero_stage=1", 4, plain_ckpt, [0]),
    }
    runs = {label: (world, strategy, resume(ckpt)) for label, (strategy, world, ckpt, _) in layouts.items()}
    resumed = Batch(tmp_path_factory, {**runs, "reference": (1, "auto", resume(plain_ckpt))}, tag="resume")
    want = resumed["reference"].losses("resume")
    assert len(want) == RESUMED_STEPS
    for label, (strategy, world, ckpt, leaders) in layouts.items():
        got = resumed[label].losses("resume", leaders)
        assert_same_losses(got, want, f"{ckpt.name} resumed by {strategy} at world {world}")


@pytest.mark.slow
def test_reshard_matrix_from_pp2_dp2_tp2(tmp_path, tmp_path_factory):
    """Saved at (pp, dp, tp) = (2, 2, 2) with ZeRO-1, loaded at (1, 4, 2), (4, 1, 2), (1, 1, 1) with ZeRO-3
    and by plain Lightning from the consolidated file: the next steps' losses equal Lightning's own resume."""
    base = {"epoch_steps": EPOCH}
    saved_ckpt, plain_ckpt = tmp_path / "pp2_dp2_tp2.ckpt", tmp_path / "plain.ckpt"
    saver = "hybrid3d:pp=2,dp=2,tp=2,zero_stage=1"
    saved = launch(tmp_path_factory, saver, 8, [{**base, "name": "save", "steps": EPOCH, "save": str(saved_ckpt)}])
    plain = launch(tmp_path_factory, "auto", 1, [{**base, "name": "save", "steps": EPOCH, "save": str(plain_ckpt)}])
    assert_same_losses(saved.losses("save", [0, 2]), plain.losses("save"), "(2, 2, 2) before saving")

    def resume(ckpt):
        return [{**base, "name": "resume", "steps": EPOCH + RESUMED_STEPS, "resume": str(ckpt)}]

    want = launch(tmp_path_factory, "auto", 1, resume(plain_ckpt), tag="_ref").losses("resume")
    one_file = consolidate(saved_ckpt, tmp_path / "consolidated.pt")
    layouts = [
        ("hybrid3d:pp=1,dp=4,tp=2,zero_stage=1", 8, saved_ckpt, [0, 2, 4, 6]),
        ("hybrid3d:pp=4,dp=1,tp=2,zero_stage=1", 8, saved_ckpt, [0]),
        ("hybrid3d:zero_stage=3", 1, saved_ckpt, [0]),
        ("auto", 1, one_file, [0]),
    ]
    for strategy, world, ckpt, leaders in layouts:
        run = launch(tmp_path_factory, strategy, world, resume(ckpt), tag="_reshard")
        assert_same_losses(run.losses("resume", leaders), want, f"(2, 2, 2) checkpoint resumed by {strategy}")
