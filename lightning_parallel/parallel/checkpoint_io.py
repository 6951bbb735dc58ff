"""Sharded checkpoint folders on disk: atomic saves, and loads that never run code from a file. Pure torch.

A folder holds torch's distributed checkpoint (``.metadata`` and one ``__<rank>_0.distcp`` per writing rank)
and ``meta.pt``: everything else of the training state (loops, schedulers, callbacks), written by rank 0.

- Atomic: the folder is written under a temporary name beside the target and renamed into place once
  every rank has finished, so a crash during a save leaves the previous checkpoint as it was.
- Safe: torch's reader unpickles ``.metadata`` with plain ``pickle`` and byte items with
  ``weights_only=False``; here ``.metadata`` goes through an unpickler that allows only DCP's metadata
  classes, tensors and byte items load with ``weights_only=True``, and so does ``meta.pt``.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

META_FILE = "meta.pt"
DCP_METADATA = ".metadata"

_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to import something a checkpoint never needs: it is refused, not run."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in _SAFE_GLOBALS.get(module, ()) or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source} refers to {module}.{name}, which a checkpoint's metadata never contains: refusing to "
            "load it (loading runs no code from checkpoint files). Was the file replaced?"
        )


class SafeReader(FileSystemReader):
    """torch's folder reader, with ``.metadata`` read through an allowlist instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} is not a distributed-checkpoint metadata file.")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's planner, with byte items loaded as weights only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file() and (path / META_FILE).is_file()


def temporary_path(path: Path, token: str) -> Path:
    """Where a save into ``path`` writes first (the same folder, so the final rename is atomic)."""
    return path.parent / f".{path.name}.partial-{token}"


def save_sharded(
    path: str | Path, tensors: dict[str, Any], meta: dict[str, Any] | None, token: str, is_rank_zero: bool
) -> None:
    """Write ``tensors`` (collective: every rank passes its pieces) and rank 0's ``meta`` into ``path``.

    Every rank must pass the same ``token`` (it names the temporary folder). Call :func:`publish` on rank 0
    after a barrier to move the folder into place.
    """
    tmp = temporary_path(Path(path), token)
    dcp.save(tensors, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True))
    if is_rank_zero:
        assert meta is not None
        torch.save(meta, tmp / META_FILE)


def publish(path: str | Path, token: str) -> None:
    """Rank 0, after every rank's :func:`save_sharded`: replace ``path`` by the finished folder."""
    path = Path(path)
    tmp = temporary_path(path, token)
    old = path.parent / f".{path.name}.old-{token}"
    if path.is_dir():
        path.rename(old)
    elif path.exists():
        path.replace(old)
    tmp.rename(path)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def load_file(file: str | Path) -> Any:
    """A ``torch.save`` file (``meta.pt``, or a one-file checkpoint) loaded as weights only."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{file} holds objects that loading would have to run code for: refusing to load it. Save "
            f"hyperparameters as plain values (numbers, strings, lists, dicts). Torch said: {err}"
        ) from None


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, loaded as weights only."""
    return load_file(Path(path) / META_FILE)


def saved_tensors(path: str | Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor a sharded checkpoint holds: name -> global shape and dtype."""
    metadata = SafeReader(path).read_metadata()
    return {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def load_sharded(path: str | Path, targets: dict[str, Any]) -> None:
    """Fill ``targets`` (each rank: its pieces, in place) from the checkpoint at ``path`` (collective)."""
    SafeReader(path).read_metadata()  # a refused file fails here with its own message, on every rank alike
    dcp.load(targets, storage_reader=SafeReader(path), planner=SafeLoadPlanner())


def full_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole, in this process (no process group needed)."""
    targets = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved_tensors(path).items()}
    load_sharded(path, targets)
    return targets
