"""A checkpoint saved under pp x tp (+ ZeRO-1) has the single-process format: it resumes in one process and
under other pipeline layouts, and a single-process checkpoint resumes under a pipeline.

As in test_zero_checkpoint, the reference is Lightning's own single-process save and resume; two steps
after resuming check the weights and the optimizer state.
"""

from __future__ import annotations

from conftest import launch
from parity import assert_same_losses

EPOCH = 5
RESUMED_STEPS = 2


def test_pipeline_checkpoint_resumes_in_any_layout(tmp_path, tmp_path_factory):
    base = {"epoch_steps": EPOCH}
    pp_ckpt, plain_ckpt = tmp_path / "pp2_tp2.ckpt", tmp_path / "plain.ckpt"
    saver = "hybrid3d:pp=2,tp=2,zero_stage=1"
    saved = launch(tmp_path_factory, saver, 4, [{**base, "name": "save", "steps": EPOCH, "save": str(pp_ckpt)}])
    plain = launch(tmp_path_factory, "auto", 1, [{**base, "name": "save", "steps": EPOCH, "save": str(plain_ckpt)}])
    assert_same_losses(saved.losses("save", [0]), plain.losses("save"), "pp=2 x tp=2 before saving")

    def resume(ckpt):
        return [{**base, "name": "resume", "steps": EPOCH + RESUMED_STEPS, "resume": str(ckpt)}]

    want = launch(tmp_path_factory, "auto", 1, resume(plain_ckpt), tag="_ref").losses("resume")
    assert len(want) == RESUMED_STEPS
    layouts = [  # (strategy, world, checkpoint, one rank per dp index)
        ("auto", 1, pp_ckpt, [0]),
        ("hybrid3d:pp=4,pp_schedule=gpipe", 4, pp_ckpt, [0]),  # other stage cuts
        ("hybrid3d:pp=2,dp=2,zero_stage=3,pp_schedule=zero_bubble", 4, pp_ckpt, [0, 1]),
        ("hybrid3d:pp=2,tp=2,zero_stage=1", 4, plain_ckpt, [0]),
    ]
    for strategy, world, ckpt, leaders in layouts:
        run = launch(tmp_path_factory, strategy, world, resume(ckpt), tag="_resume")
        assert_same_losses(run.losses("resume", leaders), want, f"{ckpt.name} resumed by {strategy} at world {world}")
