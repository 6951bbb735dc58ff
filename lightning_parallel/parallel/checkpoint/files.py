"""Sharded checkpoint folders on disk: atomic saves, and loads that never run code from a file. Pure torch.

A folder holds torch's distributed checkpoint (``.metadata`` and one ``__<rank>_0.distcp`` per writing rank)
and ``meta.pt``: everything else of the training state (loops, schedulers, callbacks), written by rank 0.

- Atomic: the folder is written under a temporary name beside the target and renamed into place once
  every rank has finished, so a crash during a save leaves the previous checkpoint as it was.
- Safe: torch's reader unpickles ``.metadata`` with plain ``pickle`` and byte items with
  ``weights_only=False``; here ``.metadata`` goes through an unpickler that allows only DCP's metadata
  classes, tensors and byte items load with ``weights_only=True``, and so does ``meta.pt``.
- Checked: ``manifest.json`` holds the size and crc32 of every other file, written when the save is
  complete; a load compares them before it changes anything. torch checks neither: a flipped byte in a
  ``.distcp`` shard or in ``meta.pt`` loaded without error (measured), and a truncated shard failed only
  half-way through filling the model. A folder without a manifest (older saves) loads unchecked.
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_parallel._compat import FsspecReader, set_element
from lightning_parallel.parallel.checkpoint import storage

META_FILE = "meta.pt"
DCP_METADATA = ".metadata"
MANIFEST_FILE = "manifest.json"
_DAMAGED_FIX = "nothing was loaded. Resume from another checkpoint (an older step folder beside it) or save again."

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


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated, damaged or missing: refused before anything is loaded from it."""


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


class _SafeMetadata:
    """``.metadata`` read through an allowlist instead of plain pickle (mixed into torch's readers)."""

    location: storage.Location
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = storage.join(self.location, DCP_METADATA)
        try:
            with storage.open_file(path) as f:
                metadata = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001  (whatever a damaged pickle raises)
            raise CorruptCheckpointError(
                f"{path} cannot be read ({type(err).__name__}: {err}): {_DAMAGED_FIX}"
            ) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} is not a distributed-checkpoint metadata file.")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(_SafeMetadata, FileSystemReader):
    """torch's folder reader, with ``.metadata`` read through an allowlist instead of plain pickle."""

    def __init__(self, path: storage.Location) -> None:
        super().__init__(path)
        self.location = path


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """torch's fsspec reader (a URL's folder), with ``.metadata`` read through the same allowlist."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.location = path


def reader(path: storage.Location) -> FileSystemReader:
    """The safe reader for a local folder or a URL's."""
    return SafeFsspecReader(str(path)) if storage.has_scheme(path) else SafeReader(path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's planner, with byte items loaded as weights only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def is_sharded_checkpoint(path: storage.Location) -> bool:
    isfile = storage.isfile
    return storage.isdir(path) and isfile(storage.join(path, DCP_METADATA)) and isfile(storage.join(path, META_FILE))


def temporary_path(path: storage.Location, token: str) -> storage.Location:
    """Where a save into ``path`` writes first (the same folder, so the final rename is atomic)."""
    return storage.join(storage.parent(path), f".{storage.name(path)}.partial-{token}")


def write_meta(folder: storage.Location, meta: dict[str, Any]) -> None:
    with storage.open_file(storage.join(folder, META_FILE), "wb") as f:
        torch.save(meta, f)


def save_sharded(
    path: storage.Location, tensors: dict[str, Any], meta: dict[str, Any] | None, token: str, is_rank_zero: bool
) -> None:
    """Write ``tensors`` (collective: every rank passes its pieces) and rank 0's ``meta`` into ``path``.

    Every rank must pass the same ``token`` (it names the temporary folder). Call :func:`publish` on rank 0
    after a barrier to move the folder into place.
    """
    tmp = temporary_path(path, token)
    dcp.save(tensors, storage_writer=storage.storage_writer(tmp))
    if is_rank_zero:
        assert meta is not None
        write_meta(tmp, meta)


def publish(path: storage.Location, token: str) -> None:
    """Rank 0, after every rank's :func:`save_sharded`: replace ``path`` by the finished folder."""
    tmp = temporary_path(path, token)
    old = storage.join(storage.parent(path), f".{storage.name(path)}.old-{token}")
    if storage.isdir(path) or storage.isfile(path):
        storage.move(path, old)
    storage.move(tmp, path)
    storage.remove(old)


def load_file(file: storage.Location) -> Any:
    """A ``torch.save`` file (``meta.pt``, or a one-file checkpoint) loaded as weights only.

    Raises:
        UnsafeCheckpointError: the file asks to import something (loading would run code).
        CorruptCheckpointError: the file is missing, truncated or not a torch file at all.
    """
    source: Any = file
    try:
        if storage.has_scheme(file):  # a URL's file, read whole (meta.pt is small)
            with storage.open_file(file) as f:
                source = io.BytesIO(f.read())
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not _refused_not_broken(source, err):
            raise CorruptCheckpointError(f"{file} is not a readable checkpoint file: {_DAMAGED_FIX}") from None
        raise UnsafeCheckpointError(
            f"{file} holds objects that loading would have to run code for: refusing to load it. Save "
            f"hyperparameters as plain values (numbers, strings, lists, dicts). Torch said: {err}"
        ) from None
    except Exception as err:  # noqa: BLE001  (a damaged file raises anything: RuntimeError from the zip reader,
        # EOFError, UnicodeDecodeError, KeyError, ...)
        reason = str(err).split(". ")[0] or type(err).__name__
        raise CorruptCheckpointError(f"{file} is truncated or damaged ({reason}): {_DAMAGED_FIX}") from None


def _refused_not_broken(file: Any, err: Exception) -> bool:
    """Whether torch refused a well-formed file (it asks to import something) rather than failed to parse it:
    torch says "Unsupported operand" for both a crafted pickle and random bytes."""
    if zipfile.is_zipfile(file):  # torch's own format: its unpickler names a refused GLOBAL
        return "GLOBAL" in str(err)
    try:
        if isinstance(file, io.BytesIO):
            file.seek(0)
        with file if isinstance(file, io.BytesIO) else open(file, "rb") as f:
            for _ in pickletools.genops(f):  # reads opcodes, runs nothing
                pass
    except Exception:  # noqa: BLE001  (any parse failure: not a pickle)
        return False
    return True


def read_meta(path: storage.Location) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, loaded as weights only."""
    return load_file(storage.join(path, META_FILE))


def saved_tensors(path: storage.Location) -> dict[str, TensorStorageMetadata]:
    """Every tensor a sharded checkpoint holds: name -> global shape and dtype."""
    metadata = reader(path).read_metadata()
    return {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def load_sharded(path: storage.Location, targets: dict[str, Any], no_dist: bool = False) -> None:
    """Fill ``targets`` (each rank: its pieces, in place) from the checkpoint at ``path`` (collective; ``no_dist``:
    this process alone, even where a process group exists)."""
    reader(path).read_metadata()  # a refused file fails here with its own message, on every rank alike
    try:
        dcp.load(targets, storage_reader=reader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as err:  # every rank gets it (DCP gathers the failures); not an Exception
        rank, (first, _) = next(iter(err.failures.items()))
        raise CorruptCheckpointError(
            f"{path}: reading the shards failed on rank {rank} ({type(first).__name__}: {first}); the tensors "
            "may be partly overwritten. Resume from another checkpoint (an older step folder beside it)."
        ) from None


def full_tensors(path: storage.Location) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole, in this process (no process group needed; one rank of a running
    group may call it alone)."""
    targets = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved_tensors(path).items()}
    load_sharded(path, targets, no_dist=True)
    return targets


def digests(folder: storage.Location, names: list[str]) -> dict[str, list[int]]:
    """``name -> [bytes, crc32]`` of files in ``folder`` (zlib's crc32 reads about 1 GB/s here)."""
    out = {}
    for name in names:
        crc, size = 0, 0
        with storage.open_file(storage.join(folder, name)) as f:
            while chunk := f.read(1 << 24):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        out[name] = [size, crc]
    return out


def data_files(folder: storage.Location) -> list[str]:
    """The files a manifest covers: every file a save wrote, sorted (each rank checks a share of them)."""
    return sorted(name for name in storage.files_in(folder) if name != MANIFEST_FILE)


def write_manifest(folder: storage.Location, files: dict[str, list[int]]) -> None:
    """Rank 0, once every file is written: the sizes and checksums :func:`check_files` compares."""
    with storage.open_file(storage.join(folder, MANIFEST_FILE), "wb") as f:
        f.write(json.dumps({"version": 1, "files": files}, sort_keys=True).encode())


def read_manifest(folder: storage.Location) -> dict[str, list[int]] | None:
    """The manifest's ``name -> [bytes, crc32]``; None for a folder saved without one."""
    path = storage.join(folder, MANIFEST_FILE)
    if not storage.isfile(path):
        return None
    try:
        with storage.open_file(path) as f:
            files = json.loads(f.read().decode())["files"]
        return {str(k): [int(v[0]), int(v[1])] for k, v in files.items()}
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path} cannot be read ({type(err).__name__}): {_DAMAGED_FIX}") from None


def check_files(folder: storage.Location, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with this rank's share of the files the manifest lists (all of them at world size 1):
    one line per missing, truncated or changed file; empty when they are as saved or there is no manifest."""
    manifest = read_manifest(folder)
    problems = []
    for name in sorted(manifest or {})[rank::world_size]:
        size, crc = manifest[name]
        file = storage.join(folder, name)
        if not storage.isfile(file):
            problems.append(f"{file} is missing")
            continue
        got_size, got_crc = digests(folder, [name])[name]
        if got_size != size:
            problems.append(f"{file} is truncated or overwritten: {got_size} bytes, {size} when saved")
        elif got_crc != crc:
            problems.append(f"{file} has changed since it was saved (crc32 {got_crc:08x}, saved {crc:08x})")
    return problems


def damaged_message(path: storage.Location, problems: list[str]) -> str:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"checkpoint {path} is damaged: {'; '.join(problems[:3])}{more}: {_DAMAGED_FIX}"


def verify(path: storage.Location) -> None:
    """Check every file of a sharded checkpoint against its manifest, in this process.

    Raises:
        CorruptCheckpointError: naming the files that are missing, truncated or changed.
    """
    problems = check_files(path)
    if problems:
        raise CorruptCheckpointError(damaged_message(path, problems))


def model_mismatch(
    path: storage.Location, expected: dict[str, tuple], saved: dict[str, tuple], strict: bool
) -> str | None:
    """Why a checkpoint's model tensors (``saved``: name -> shape) do not fit the model (``expected``), or
    None. Missing and unexpected names count only when ``strict`` (Lightning's ``strict_loading``)."""

    def few(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    parts = []
    differ = [k for k in sorted(expected) if k in saved and tuple(saved[k]) != tuple(expected[k])]
    shapes = [f"{k} {tuple(saved[k])} saved, {tuple(expected[k])} here" for k in differ]
    if shapes:
        parts.append(f"different shapes: {few(shapes)}")
    if strict:
        missing = [f"{k} {tuple(expected[k])}" for k in sorted(expected) if k not in saved]
        extra = [f"{k} {tuple(saved[k])}" for k in sorted(saved) if k not in expected]
        parts += [f"missing from the checkpoint: {few(missing)}"] if missing else []
        parts += [f"not in this model: {few(extra)}"] if extra else []
    if not parts:
        return None
    return (
        f"{path} was saved from a different model ({'; '.join(parts)}): nothing was loaded. Resume with the "
        "model configuration that wrote it (the same model= sizes), or start without ckpt_path."
    )
