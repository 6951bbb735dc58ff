"""Damaged checkpoints, checkpoints of another model and a full disk: refused with a message that names the
file and what to do, before anything is loaded, on every rank alike; a failed save leaves the previous
checkpoint loadable and no temporary folder behind.

Without the manifest (sizes and crc32 of every file, checked before loading) torch loads a shard with a
flipped byte silently (the first test shows it), and a cut shard fails half-way through filling the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from harness import run_worker

from lightning_parallel.checkpoint import consolidate, consolidated, main
from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.models.vgg import VGG, VGGConfig
from lightning_parallel.parallel.checkpoint import files as checkpoint_io

SHARD = "__0_0.distcp"
GARBAGE = bytes(range(256)) * 16  # not a zip, and not a pickle (0x00 is no opcode)


def sealed_save(path: Path, tensors: dict, meta: dict, token: str = "t") -> None:
    """A save as the strategy makes it, in one process: the folder, its manifest, then the rename."""
    checkpoint_io.save_sharded(path, tensors, meta, token, is_rank_zero=True)
    tmp = checkpoint_io.temporary_path(path, token)
    checkpoint_io.write_manifest(tmp, checkpoint_io.digests(tmp, checkpoint_io.data_files(tmp)))
    checkpoint_io.publish(path, token)


def flip(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    file.write_bytes(bytes(data))


def cut(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGE = {
    "shard_flipped": (SHARD, flip),
    "shard_cut": (SHARD, cut),
    "shard_missing": (SHARD, Path.unlink),
    "meta_flipped": (checkpoint_io.META_FILE, flip),
    "metadata_cut": (checkpoint_io.DCP_METADATA, cut),
    "manifest_garbage": (checkpoint_io.MANIFEST_FILE, lambda f: f.write_bytes(os.urandom(64))),
}


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    tensors = {"w": torch.randn(64, 64), "b": torch.randn(64)}  # saved as a model's state_dict
    sealed_save(tmp_path / "good.ckpt", {f"state_dict.{k}": v.clone() for k, v in tensors.items()}, {"global_step": 7})
    return tmp_path / "good.ckpt", tensors


def test_the_manifest_catches_what_torch_loads_silently(saved):
    good, tensors = saved
    flipped = good.parent / "flipped.ckpt"
    shutil.copytree(good, flipped)
    data = (flipped / SHARD).read_bytes()
    at = data.index(tensors["w"].numpy().tobytes()[400:432])  # a byte of w's values, not of a zip header
    (flipped / SHARD).write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    out = {f"state_dict.{k}": torch.zeros_like(v) for k, v in tensors.items()}
    checkpoint_io.load_sharded(flipped, out)  # torch alone: no error, and a different tensor
    assert not torch.equal(out["state_dict.w"], tensors["w"])
    checkpoint_io.verify(good)
    assert all(torch.equal(consolidated(good)["state_dict"][k], v) for k, v in tensors.items())


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_folder_is_refused_naming_the_file(case, saved, tmp_path, capsys):
    good, _ = saved
    damaged = tmp_path / case
    shutil.copytree(good, damaged)
    name, damage = DAMAGE[case]
    damage(damaged / name)
    with pytest.raises(checkpoint_io.CorruptCheckpointError, match=rf"{damaged / name}.*Resume from another"):
        consolidated(damaged)
    assert main(["consolidate", str(damaged), str(tmp_path / "out.pt")]) == 2
    assert str(damaged / name) in capsys.readouterr().err and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("case", ["cut", "garbage", "empty"])
def test_a_damaged_one_file_checkpoint_is_refused(case, saved, tmp_path):
    one = consolidate(saved[0], tmp_path / "one.ckpt")
    torch.load(one, weights_only=True)  # whole, it loads
    data = {"cut": one.read_bytes()[: one.stat().st_size // 2], "garbage": GARBAGE, "empty": b""}[case]
    one.write_bytes(data)
    with pytest.raises(checkpoint_io.CorruptCheckpointError, match=rf"{one} is .*nothing was loaded"):
        checkpoint_io.load_file(one)


def shapes(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_another_model_is_named_with_a_few_names_and_shapes():
    tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32)
    here = shapes(RecipeGPT(tiny))
    assert checkpoint_io.model_mismatch("ck", here, shapes(RecipeGPT(tiny)), strict=True) is None
    wider = shapes(RecipeGPT(GPTConfig(**{**vars(tiny), "d_model": 64})))
    wide = checkpoint_io.model_mismatch("ck", here, wider, strict=True)
    assert "different shapes: " in wide and "blocks.0.attn.k.weight (64, 64) saved, (32, 32) here" in wide
    deep = checkpoint_io.model_mismatch("ck", here, shapes(RecipeGPT(GPTConfig(**{**vars(tiny), "n_layer": 6}))), True)
    assert "not in this model: blocks.2." in deep and "and " in deep and "different shapes" not in deep
    vgg = checkpoint_io.model_mismatch("ck", here, shapes(VGG(VGGConfig(name="vgg11", width=8))), True)
    assert "missing from the checkpoint: blocks.0." in vgg and "not in this model: " in vgg
    assert vgg.startswith("ck was saved from a different model") and "nothing was loaded" in vgg
    # strict_loading=False: other names are the user's business, other shapes never load
    assert checkpoint_io.model_mismatch("ck", here, {}, strict=False) is None
    assert "different shapes" in checkpoint_io.model_mismatch(
        "ck", here, shapes(RecipeGPT(GPTConfig(**{**vars(tiny), "d_model": 64}))), False
    )


STRATEGY = "hybrid3d:pp=2"  # each rank holds other tensors: a rank alone would see only its stage's names


def launch(tmp_path: Path, tag: str, cases: list[dict]) -> tuple[list[dict[str, dict]], Path]:
    out = tmp_path / tag
    results = run_worker("integrity", 2, ["--strategy", STRATEGY, "--cases", json.dumps(cases)], out)
    return [{c["name"]: c for c in rank} for rank in results], out


def test_bad_checkpoints_and_a_full_disk_fail_on_every_rank_and_the_last_good_one_resumes(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    good, deep, wide, reference = ck / "good.ckpt", ck / "deep.ckpt", ck / "wide.ckpt", tmp_path / "reference.ckpt"
    first, _ = launch(
        tmp_path,
        "save",
        [
            {"name": "init", "steps": 0},
            {"name": "reference", "steps": 2, "save": str(reference)},
            {"name": "deep", "steps": 1, "config": "deep", "save": str(deep)},
            {"name": "wide", "steps": 1, "config": "wide", "save": str(wide)},
            {"name": "good", "steps": 2, "save": str(good)},
            {"name": "full", "steps": 3, "save": str(good), "enospc_rank": 1},  # overwrites good: a disk full
        ],
    )
    for rank in first:  # every rank got the same error, none hung
        assert rank["full"]["save_errno"] == 28 and rank["full"]["save_error"] == first[0]["full"]["save_error"]
        assert "no space left on device while saving checkpoint" in rank["full"]["save_error"]
        assert f"change checkpoint.dir; the previous checkpoint {good} is intact" in rank["full"]["save_error"]
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"
    assert checkpoint_io.read_meta(good)["global_step"] == 2
    checkpoint_io.verify(good)

    bad = {}
    for case, (name, damage) in DAMAGE.items():
        bad[case] = tmp_path / case
        shutil.copytree(good, bad[case])
        damage(bad[case] / (name if name != SHARD else "__1_0.distcp"))  # rank 1's shard: rank 0's part is fine
    bad["one_file_garbage"] = tmp_path / "garbage.ckpt"
    bad["one_file_garbage"].write_bytes(GARBAGE)
    bad |= {"deep": deep, "wide": wide}
    cases = [{"name": k, "steps": 4, "resume": str(v), "expect_error": True} for k, v in bad.items()]
    resumes = [{"name": n, "steps": 4, "resume": str(p)} for n, p in (("resumed", good), ("reference", reference))]
    second, out2 = launch(tmp_path, "load", [*cases, *resumes])

    expected = {case: f"{bad[case] / (n if n != SHARD else '__1_0.distcp')}" for case, (n, _) in DAMAGE.items()}
    expected |= {"one_file_garbage": f"{bad['one_file_garbage']} is not a readable checkpoint", "deep": "blocks.2."}
    expected["wide"] = "attn.k.weight (64, 64) saved, (32, 32) here"
    for case in bad:
        errors = [rank[case].get("error") for rank in second]
        assert errors[0] and errors[0] == errors[1], f"{case}: every rank must raise the same error, got {errors}"
        assert expected[case] in errors[0], f"{case}: {errors[0]}"
        assert "nothing was loaded" in errors[0], f"{case}: {errors[0]}"
        for r, rank in enumerate(second):  # nothing changed: each rank still holds the initial weights
            assert rank[case]["checksum"] == first[r]["init"]["checksum"], f"{case}: rank {r} was changed"
    # the checkpoint a full disk failed to replace resumes like the same state saved where nothing failed
    want = torch.load(out2 / "reference_params.pt", weights_only=True)
    got = torch.load(out2 / "resumed_params.pt", weights_only=True)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), "resume after a full disk"
