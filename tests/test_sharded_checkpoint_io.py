"""Sharded checkpoint pieces without a process group: flat ranges as rectangles, atomic saves, and loading
that refuses to run code from a checkpoint."""

from __future__ import annotations

import math
import os
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_parallel.checkpoint import consolidate, main
from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint.chunks import chunked_view, flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_flat_ranges_become_contiguous_rectangles(shape):
    numel, rng = math.prod(shape), random.Random(0)
    full = torch.arange(numel).view(shape)
    for _ in range(40):
        start = rng.randrange(numel)
        end = rng.randrange(start, numel + 1)
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offsets, sizes, flat_start in boxes:
            block = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            # the rectangle is exactly the flat run that starts at flat_start
            assert torch.equal(block.reshape(-1), torch.arange(flat_start, flat_start + block.numel()))
            covered += block.reshape(-1).tolist()
        assert covered == list(range(start, end))


def save(path, tensors, meta, token="t"):
    checkpoint_io.save_sharded(path, tensors, meta, token, is_rank_zero=True)
    checkpoint_io.publish(path, token)


def test_pieces_of_flat_buffers_save_and_load_in_place(tmp_path):
    """Two ZeRO ranks' flat slices of one (6, 7) tensor, cut at 17: rank 0's pieces hold 0..16 (a full
    row block and part of a row), and load back into a differently cut buffer (rank 1 of a 3-way cut)."""
    full = torch.randn(6, 7)
    flat = full.reshape(-1)
    first = chunked_view(flat[:17].clone(), 0, (6, 7), (0, 0), (6, 7))
    save(tmp_path / "ck", {"w": first}, {"step": 1})
    whole = torch.zeros(6, 7)
    checkpoint_io.load_sharded(tmp_path / "ck", {"w": whole})
    assert torch.equal(whole.reshape(-1)[:17], flat[:17])
    other = torch.zeros(14)  # elements 14..27 of the flattened tensor: only 14..16 were saved
    checkpoint_io.load_sharded(tmp_path / "ck", {"w": chunked_view(other, 14, (6, 7), (0, 0), (6, 7))})
    assert torch.equal(other[:3], flat[14:17])


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save(path, {"w": torch.ones(4)}, {"step": 1}, "first")

    def crash(*args, **kwargs):
        raise RuntimeError("killed while writing")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", crash)  # the tensors are written, the index is not
    with pytest.raises(CheckpointException, match="killed while writing"):  # DCP wraps the crash
        save(path, {"w": torch.full((4,), 2.0)}, {"step": 2}, "second")
    monkeypatch.undo()
    assert checkpoint_io.read_meta(path) == {"step": 1}
    out = torch.zeros(4)
    checkpoint_io.load_sharded(path, {"w": out})
    assert torch.equal(out, torch.ones(4))
    assert (tmp_path / ".last.ckpt.partial-second").is_dir()  # the half-written one, under another name
    save(path, {"w": torch.full((4,), 3.0)}, {"step": 3}, "third")  # the next save replaces the old one
    assert checkpoint_io.read_meta(path) == {"step": 3}


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_never_runs_code_from_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ck"
    save(path, {"w": torch.ones(2)}, {"step": 1})
    (path / checkpoint_io.META_FILE).write_bytes(pickle.dumps({"step": Payload()}))
    with pytest.raises(checkpoint_io.UnsafeCheckpointError, match="refusing to load it"):
        checkpoint_io.read_meta(path)
    save(path, {"w": torch.ones(2)}, {"step": 1}, "again")
    (path / checkpoint_io.DCP_METADATA).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint_io.UnsafeCheckpointError, match=r"posix.system|os.system"):
        checkpoint_io.load_sharded(path, {"w": torch.zeros(2)})
    one_file = tmp_path / "one.ckpt"
    one_file.write_bytes(pickle.dumps({"state_dict": Payload()}))
    with pytest.raises(checkpoint_io.UnsafeCheckpointError, match="refusing to load it"):
        checkpoint_io.load_file(one_file)
    assert not (tmp_path / "pwned").exists()


def test_consolidate_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "is neither a checkpoint file nor a sharded checkpoint folder" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="one needs .metadata and meta.pt"):
        consolidate(tmp_path / "missing", tmp_path / "out.pt")


def test_consolidate_passes_a_one_file_checkpoint_through(tmp_path):
    """What Lightning's own strategies (and checkpoint_format="full") write is already one ordinary file."""
    one_file = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 4}, one_file)
    assert main(["consolidate", str(one_file), str(tmp_path / "out.pt")]) == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["global_step"] == 4 and torch.equal(out["state_dict"]["w"], torch.ones(3))
    assert main(["info", str(one_file)]) == 0
