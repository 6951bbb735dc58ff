"""A sharded checkpoint read in one process: the path checked before anything reads it, the whole checkpoint in the
single-process format (:func:`consolidated`), written as one file (:func:`consolidate`) or summarized (:func:`info`).
The command line over them is :mod:`lightning_parallel.checkpoint`."""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint.sharded import full_order_checkpoint


def _check_folder(path: Path) -> None:
    if not checkpoint_io.is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is neither a checkpoint file nor a sharded checkpoint folder (one needs .metadata and "
            "meta.pt): give what a save wrote."
        )


def check_checkpoint_path(path: str | Path, setting: str = "ckpt_path") -> None:
    """Refuse, without reading it, a ``path`` that cannot be a checkpoint: missing, a folder without a sharded
    checkpoint's files, or a file that is not a ``torch.save`` archive (an empty, cut or text file).

    Args:
        path: what the user gave.
        setting: the setting's name for the message.

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder that holds no sharded checkpoint.
        ValueError: a file that is not a torch checkpoint file.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{setting}={str(path)!r} does not exist: give a saved checkpoint (file or folder).")
    if p.is_dir():
        if not checkpoint_io.is_sharded_checkpoint(p):
            raise FileNotFoundError(
                f"{setting}={str(path)!r} is a folder but not a sharded checkpoint (one holds .metadata and "
                f"{checkpoint_io.META_FILE}): give the folder a save wrote (e.g. last.ckpt in it) or a checkpoint file."
            )
        return
    # torch.save writes a zip archive (its central directory is at the end, so a cut file fails this too);
    # the legacy format is a pickle, which starts with the PROTO opcode
    with open(p, "rb") as f:
        head = f.read(1)
    if not (zipfile.is_zipfile(p) or head == b"\x80"):
        raise ValueError(
            f"{setting}={str(path)!r} is not a checkpoint file (not a torch.save archive; empty or cut short?): "
            "give a file or folder a save wrote."
        )


def consolidated(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint at ``path``, in the single-process format, in this process (no process group).
    A one-file checkpoint (``checkpoint_format="full"``, or Lightning's own) is already in it: it is read
    as weights only and returned as it is."""
    path = Path(path)
    if path.is_file():
        return checkpoint_io.load_file(path)
    _check_folder(path)
    checkpoint_io.verify(path)  # a damaged file is named before anything is read from it
    meta = checkpoint_io.read_meta(path)
    groups = [o["param_groups"] for o in meta.get("optimizer_states", [])]
    return {**meta, **full_order_checkpoint(checkpoint_io.full_tensors(path), groups)}


def consolidate(path: str | Path, out: str | Path) -> Path:
    """Write :func:`consolidated` to ``out`` (atomically: a crash leaves no half-written file)."""
    out = Path(out)
    if out.resolve() == Path(path).resolve():
        raise ValueError(f"consolidate would overwrite its input {path}: give another OUT path.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    torch.save(consolidated(path), tmp)
    tmp.replace(out)
    return out


def info(path: str | Path) -> str:
    """One line: epoch, step, how many model tensors and optimizers, and the size of the tensors."""
    path = Path(path)
    if path.is_file():
        whole = checkpoint_io.load_file(path)
        meta, model = whole, len(whole.get("state_dict", {}))
        size = sum(t.numel() * t.element_size() for t in whole.get("state_dict", {}).values() if torch.is_tensor(t))
        kind = "one file"
    else:
        _check_folder(path)
        meta, tensors = checkpoint_io.read_meta(path), checkpoint_io.saved_tensors(path)
        model = sum(1 for k in tensors if k.startswith("state_dict."))
        size = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in tensors.values())
        kind = f"sharded, {len(tensors)} tensors in all"
    return (
        f"{path} ({kind}): epoch {meta.get('epoch')}, global step {meta.get('global_step')}, {model} model tensors, "
        f"{len(meta.get('optimizer_states', []))} optimizer(s), {size / 2**20:.1f} MiB"
    )
