"""A zero3 checkpoint (a sharded folder) saved at world 4 resumes at world 2 under zero3 and zero1, and in a
plain single process once consolidated into one file.

The reference is Lightning itself: a plain single-process run that saved and resumed its own checkpoint at
the same step. Two steps after resuming are compared: the first checks the weights, the second the
optimizer state (Adam's moments move the second step's weights).
"""

from __future__ import annotations

import torch
from conftest import Batch, launch
from parity import assert_same_losses

from lightning_parallel.checkpoint import consolidate, info
from lightning_parallel.parallel.checkpoint import files as checkpoint_io

EPOCH = 5  # checkpoints are taken after the first epoch
RESUMED_STEPS = 2


def test_zero3_checkpoint_resumes_at_other_world_sizes(tmp_path, tmp_path_factory):
    base = {"epoch_steps": EPOCH}
    zero3_ckpt, plain_ckpt = tmp_path / "zero3_w4.ckpt", tmp_path / "plain.ckpt"

    def save(path):
        return [{**base, "name": "save", "steps": EPOCH, "save": str(path)}]

    saves = Batch(tmp_path_factory, {"zero3": (4, "zero3", save(zero3_ckpt)), "plain": (1, "auto", save(plain_ckpt))})
    assert_same_losses(saves["zero3"].losses("save"), saves["plain"].losses("save"), "zero3 world 4 before saving")
    assert zero3_ckpt.is_dir() and (zero3_ckpt / "meta.pt").is_file()
    one_file = consolidate(zero3_ckpt, tmp_path / "zero3_w4_consolidated.pt")

    def resume(ckpt):
        return [{**base, "name": "resume", "steps": EPOCH + RESUMED_STEPS, "resume": str(ckpt)}]

    layouts = [("zero3", 2, zero3_ckpt), ("zero1", 2, zero3_ckpt), ("auto", 1, one_file)]
    runs = {strategy: (world, strategy, resume(ckpt)) for strategy, world, ckpt in layouts}
    resumed = Batch(tmp_path_factory, {**runs, "reference": (1, "auto", resume(plain_ckpt))}, tag="resume")
    want = resumed["reference"].losses("resume")
    assert len(want) == RESUMED_STEPS
    for strategy, world, _ in layouts:
        got = resumed[strategy].losses("resume")
        assert_same_losses(got, want, f"zero3 world-4 checkpoint resumed by {strategy} at world {world}")


def test_weights_only_save_writes_no_optimizer_state(tmp_path, tmp_path_factory):
    ckpt = tmp_path / "weights.ckpt"
    case = {"epoch_steps": EPOCH, "name": "save", "steps": 2, "save": str(ckpt), "weights_only": True}
    run = launch(tmp_path_factory, "zero2", 2, [case])
    saved = checkpoint_io.saved_tensors(ckpt)
    assert saved and all(k.startswith("state_dict.") for k in saved)
    assert "(sharded, " in info(ckpt) and "global step 2, " in info(ckpt) and "0 optimizer(s)" in info(ckpt)
    one_file = torch.load(consolidate(ckpt, tmp_path / "weights.pt"), weights_only=True)
    assert one_file["optimizer_states"] == [] and one_file["state_dict"].keys() == run.params("save").keys()
