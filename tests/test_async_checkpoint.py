"""Asynchronous sharded saves (``async_save=True``): the same folders as a synchronous save, resumed at another
layout with the same next losses; a save is in place only once complete, so a failed or killed save leaves the
previous checkpoint (and ``last``) as it was and its partial folder is never taken for a checkpoint."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from conftest import Batch
from harness import run_worker
from parity import assert_same_losses

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint.async_save import AsyncCheckpointer, HostStager
from lightning_parallel.parallel.checkpoint.chunks import chunked_view

WORKER = "async_ckpt"
STEP2, STEP4 = "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"  # two steps an epoch: saves at epochs' ends


def saving(folder: Path, asynchronous: bool, steps: int = 4) -> list[dict]:
    return [{"name": "save", "steps": steps, "every": 2, "dir": str(folder), "async": asynchronous}]


def resuming(ckpt: Path | str, steps: int) -> list[dict]:
    return [{"name": "resume", "steps": steps, "resume": str(ckpt)}]


def test_async_save_resumes_at_another_layout_like_the_sync_save(tmp_path, tmp_path_factory):
    """zero2 (ZeRO's flat buffers: chunked pieces), tp=2 and zero3 (DTensors; zero3 into a local:// URL through
    fsspec) at world 2 save every 2 steps, async and sync; each step=2 folder and each last.ckpt resumes in one
    process with the sync save's next losses."""
    dirs = {label: tmp_path / label for label in ("sync", "async", "async_tp", "async_url")}
    # fsspec's local file system through a URL (local://: Lightning's ModelCheckpoint rewrites file:// as a local path)
    url = f"local://{dirs['async_url']}"
    saves = Batch(
        tmp_path_factory,
        {
            "sync": (2, "zero2", saving(dirs["sync"], False)),
            "async": (2, "zero2", saving(dirs["async"], True)),
            "async_tp": (2, "hybrid3d:tp=2", saving(dirs["async_tp"], True)),
            "async_url": (2, "zero3", [{**saving(dirs["async_url"], True)[0], "dir": url}]),
        },
        worker=WORKER,
    )
    trained = saves["sync"].losses("save")
    for label in ("async", "async_tp", "async_url"):
        assert_same_losses(saves[label].losses("save"), trained, f"{label}: training with async saves")
        assert saves[label].case("save")["closed"], "teardown left the async saver open"
    for folder in dirs.values():
        assert sorted(p.name for p in folder.iterdir()) == sorted([STEP2, STEP4, "last.ckpt"]), folder
        for name in (STEP2, STEP4, "last.ckpt"):
            checkpoint_io.verify(folder / name)  # complete: every file as its manifest says
    # last.ckpt is the step-4 save again: linked, not written twice
    shard = "__0_0.distcp"
    assert os.stat(dirs["async"] / "last.ckpt" / shard).st_ino == os.stat(dirs["async"] / STEP4 / shard).st_ino
    runs = {f"{label}_{name}": (1, "hybrid3d", resuming(dirs[label] / name, steps)) for label in dirs for name, steps in
            ((STEP2, 4), ("last.ckpt", 6))}  # fmt: skip
    runs[f"async_url_{STEP2}"] = (1, "hybrid3d", resuming(f"{url}/{STEP2}", 4))  # read through fsspec
    resumed = Batch(tmp_path_factory, runs, tag="resume", worker=WORKER)
    assert_same_losses(resumed[f"sync_{STEP2}"].losses("resume"), trained[2:], "sync step 2 resumed at world 1")
    for label in ("async", "async_tp", "async_url"):
        for name in (STEP2, "last.ckpt"):
            want = resumed[f"sync_{name}"].losses("resume")
            assert len(want) == 2
            assert_same_losses(resumed[f"{label}_{name}"].losses("resume"), want, f"{label} {name} resumed")


@pytest.mark.slow
def test_sigkill_during_an_async_save_leaves_last_resumable(tmp_path, tmp_path_factory):
    """Rank processes killed while the step-4 save is still being written: last.ckpt is the step-2 save, the
    partial folder is hidden and ignored, and resuming from last at world 2 gives the uninterrupted losses."""
    folder = tmp_path / "ckpts"
    killed = {**saving(folder, True, steps=6)[0], "slow_write": 0.5, "kill_at": 4}
    with pytest.raises(AssertionError, match="exited"):
        run_worker(WORKER, 2, ["--runs-file", _runs_file(tmp_path, [killed])], tmp_path / "killed")
    partial = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert partial and all(".partial-" in name for name in partial), partial
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [STEP2, "last.ckpt"]
    assert checkpoint_io.read_meta(folder / "last.ckpt")["global_step"] == 2
    runs = {
        "whole": (2, "zero2", saving(tmp_path / "whole", True, steps=6)),
        "resumed": (2, "zero2", [{"name": "save", "steps": 6, "resume": "last", "dir": str(folder), "async": True}]),
    }
    batch = Batch(tmp_path_factory, runs, worker=WORKER)
    assert_same_losses(batch["resumed"].losses("save"), batch["whole"].losses("save")[2:], "resumed after SIGKILL")


def _runs_file(tmp_path: Path, cases: list[dict]) -> str:
    import json

    path = tmp_path / "runs.json"
    path.write_text(json.dumps([{"label": "killed", "strategy": "zero2", "cases": cases}]))
    return str(path)


# ----- single process: the saver itself -----


def _state(scale: float) -> dict[str, torch.Tensor]:
    flat = torch.arange(10, dtype=torch.float32) * scale
    return {
        "w": torch.full((3, 4), scale),
        "flat": chunked_view(flat[2:9], 2, (2, 5), (0, 0), (2, 5)),  # a ZeRO-1/2 slice of a (2, 5) tensor
    }


def test_stager_copies_chunked_pieces_to_fresh_host_memory():
    state = _state(1.0)
    staged = HostStager().stage(state)
    assert torch.equal(staged["w"], state["w"]) and staged["w"].data_ptr() != state["w"].data_ptr()
    (offsets, data), (offsets2, data2) = state["flat"]._chunks[0], staged["flat"]._chunks[0]
    assert offsets == offsets2 and torch.equal(data, data2) and data.data_ptr() != data2.data_ptr()
    state["w"].add_(1)  # training goes on: the staged copy keeps the saved values
    assert torch.equal(staged["w"], torch.full((3, 4), 1.0))


def test_a_failed_async_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The write of the second save fails half-way (one process; a SIGKILL's effect on disk is the same: the
    target was never renamed): the first save is intact at its path, the second is nowhere, nothing partial stays."""
    saver = AsyncCheckpointer(0, 1, timeout=None)  # type: ignore[arg-type]
    first, second = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    saver.save(first, "a", _state(1.0), {"global_step": 1}, step=1)
    assert saver.finish() == [] and checkpoint_io.is_sharded_checkpoint(first)
    original, release, written = dcp_fs._write_item, threading.Event(), threading.Event()

    def write_item(*args, **kwargs):
        written.set()
        release.wait(30)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    saver.save(second, "b", _state(2.0), {"global_step": 2}, step=2)
    assert saver.alias(tmp_path / "last.ckpt", "c", {"global_step": 2}, 2, {"w", "flat"})
    saver.remove_later(first)  # as ModelCheckpoint asks while the save is in flight: not before it is complete
    assert written.wait(30)
    assert saver.in_flight and not second.exists() and checkpoint_io.is_sharded_checkpoint(first)
    release.set()
    failures = saver.close()
    monkeypatch.setattr(dcp_fs, "_write_item", original)
    assert failures and "No space left" in failures[0][2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=1.ckpt"]  # no partial folder, first kept
    checkpoint_io.verify(first)
    loaded = checkpoint_io.full_tensors(first)
    assert torch.equal(loaded["w"], torch.full((3, 4), 1.0))
    assert torch.equal(loaded["flat"].flatten()[2:9], torch.arange(2, 9, dtype=torch.float32))


def test_a_save_of_the_same_step_after_the_write_finished_is_linked_at_once(tmp_path):
    """The writer thread may be past its aliases when ``last.ckpt`` is asked for: then alias() makes it."""
    saver = AsyncCheckpointer(0, 1, timeout=None)  # type: ignore[arg-type]
    first, last = tmp_path / "step=1.ckpt", tmp_path / "last.ckpt"
    saver.save(first, "a", _state(1.0), {"global_step": 1}, step=1)
    saver._done.result()  # the write is complete, the writer sealed its aliases
    assert saver.alias(last, "b", {"global_step": 1, "last": True}, 1, {"w", "flat"})
    assert saver.close() == []
    checkpoint_io.verify(last)
    assert checkpoint_io.read_meta(last)["last"] is True and checkpoint_io.read_meta(first)["global_step"] == 1
    shards = [p.name for p in first.iterdir() if p.suffix == ".distcp"]
    assert shards and all(os.stat(first / n).st_ino == os.stat(last / n).st_ino for n in shards)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=1.ckpt"]


def test_async_save_setting_is_checked_before_launch():
    from lightning_parallel import ZeroStrategy

    with pytest.raises(ValueError, match="checkpoint_format='sharded'"):
        ZeroStrategy(stage=1, async_save=True, checkpoint_format="full")
    with pytest.raises(TypeError, match="async_save='yes' must be True or False"):
        ZeroStrategy(stage=1, async_save="yes")


def test_recipe_async_save_reaches_the_strategy_and_is_refused_where_it_cannot_work(tmp_path):
    from test_recipe_configs import compose_gpt

    from lightning_parallel.recipes.common import build_trainer, check_run_settings

    cfg = compose_gpt("strategy=zero2", "trainer.devices=2", "checkpoint=periodic", "checkpoint.async_save=true")
    check_run_settings(cfg, num_layers=4)
    assert build_trainer(cfg, tmp_path).strategy.async_save is True
    assert build_trainer(compose_gpt("strategy=zero2", "trainer.devices=2"), tmp_path).strategy.async_save is False
    with pytest.raises(ValueError, match="checkpoint.async_save=true has nothing to save"):
        check_run_settings(compose_gpt("strategy=zero2", "trainer.devices=2", "checkpoint.async_save=true"), 4)
    ddp = compose_gpt("strategy=ddp", "trainer.devices=2", "checkpoint=periodic", "checkpoint.async_save=true")
    with pytest.raises(ValueError, match="strategy=ddp does not write them"):
        check_run_settings(ddp, 4)


def test_memory_url_round_trip_resumes_with_the_same_next_losses(tmp_path, tmp_path_factory):
    """fsspec's in-memory file system (one process: runs of one launch share it): saved there, resumed from
    there, the next losses equal those resumed from a local folder."""
    memory = f"memory://{tmp_path.name}/ckpts"
    cases = {
        "memory": [saving(memory, True)[0], {"name": "resume", "steps": 6, "resume": f"{memory}/{STEP4}"}],
        "local": [saving(tmp_path / "local", False)[0], resuming(tmp_path / "local" / STEP4, 6)[0]],
    }
    batch = Batch(tmp_path_factory, {k: (1, "hybrid3d", v) for k, v in cases.items()}, tag="memory", worker=WORKER)
    assert_same_losses(batch["memory"].losses("save"), batch["local"].losses("save"), "training, saving to memory://")
    want = batch["local"].losses("resume")
    assert len(want) == 2
    assert_same_losses(batch["memory"].losses("resume"), want, "resumed from memory://")


def test_unknown_or_uninstalled_schemes_are_refused_before_launch():
    from lightning_parallel.parallel.checkpoint.storage import check_storage

    check_storage("memory://x", "checkpoint.dir")
    check_storage("/local/folder", "checkpoint.dir")
    with pytest.raises(ValueError, match="checkpoint.dir='nosuch://b/x': fsspec knows no file system nosuch://"):
        check_storage("nosuch://b/x", "checkpoint.dir")
    with pytest.raises(ValueError, match="needs the fsspec package for s3://, 's3fs', which is not installed"):
        check_storage("s3://bucket/ckpts", "checkpoint.dir")


def test_recipe_checks_url_folders_and_resolves_last_under_a_url(tmp_path):
    import fsspec
    from test_recipe_configs import compose_gpt

    from lightning_parallel.recipes.common import check_run_settings, resume_path

    base = ("strategy=zero2", "trainer.devices=2", "checkpoint=periodic")
    with pytest.raises(ValueError, match="checkpoint.dir='nosuch://x': fsspec knows no file system"):
        check_run_settings(compose_gpt(*base, "checkpoint.dir=nosuch://x"), 4)
    with pytest.raises(ValueError, match="ckpt_path='s3://b/last.ckpt' needs the fsspec package for s3://, 's3fs'"):
        check_run_settings(compose_gpt(*base, "ckpt_path=s3://b/last.ckpt"), 4)
    folder = f"memory://{tmp_path.name}/ckpts"
    cfg = compose_gpt(*base, f"checkpoint.dir={folder}", "ckpt_path=last")
    assert resume_path(cfg) is None  # nothing saved yet: a fresh start, as Lightning does for a local folder
    fs = fsspec.filesystem("memory")
    for name in (".metadata", "meta.pt"):
        fs.pipe(f"/{tmp_path.name}/ckpts/last.ckpt/{name}", b"x")
    assert resume_path(cfg) == f"{folder}/last.ckpt"
    assert resume_path(compose_gpt(*base, "ckpt_path=last")) == "last"  # a local folder: Lightning's lookup
