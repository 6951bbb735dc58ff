"""Where checkpoint folders live: a local path (pathlib and os, as always), or a URL with a scheme (``s3://``,
``gs://``, ``memory://``, ``file://``, ...) through fsspec and torch's DCP fsspec reader and writer. Pure torch.

Every function takes either; a URL stays a string (``Path`` would fold its ``//``). Object stores have no
atomic rename: a folder is still written under a hidden temporary name and moved into place when complete,
and its ``manifest.json`` (written last) is what a load checks, so a half-moved folder is refused, not loaded.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.registry import known_implementations

from lightning_parallel._compat import FsspecWriter

Location = str | Path


def has_scheme(path: Location) -> bool:
    """Whether ``path`` is a URL (``proto://...``): read and written through fsspec."""
    return isinstance(path, str) and "://" in path


def check_storage(path: Location, setting: str) -> None:
    """Refuse, before launch, a URL whose file system fsspec does not know or whose package is not installed.

    Raises:
        ValueError: naming ``setting``, the scheme and the package to install.
    """
    if not has_scheme(path):
        return
    protocol = str(path).split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:  # known to fsspec, its package missing ("Install s3fs to access S3")
        known = known_implementations.get(protocol, {})
        package = known.get("class", "").split(".")[0]
        raise ValueError(
            f"{setting}={path!r} needs the fsspec package for {protocol}://, {package!r}, which is not installed: "
            f"pip install {package} ({err}), or use a local folder."
        ) from None
    except ValueError:
        raise ValueError(
            f"{setting}={path!r}: fsspec knows no file system {protocol}://. Use a local folder or a URL fsspec "
            "reads (s3://, gs://, az://, memory://, file://, ... with its package installed)."
        ) from None


def filesystem(path: Location) -> tuple[Any, str]:
    """fsspec's file system for a URL and the path inside it."""
    return url_to_fs(str(path))


def join(path: Location, *names: str) -> Location:
    return posixpath.join(path, *names) if has_scheme(path) else Path(path, *names)


def parent(path: Location) -> Location:
    return posixpath.dirname(str(path).rstrip("/")) if has_scheme(path) else Path(path).parent


def name(path: Location) -> str:
    return posixpath.basename(str(path).rstrip("/")) if has_scheme(path) else Path(path).name


def local(path: Location) -> Location:
    """A ``str`` local path as a ``Path``; a URL as it is."""
    return path if has_scheme(path) else Path(path)


def isdir(path: Location) -> bool:
    if not has_scheme(path):
        return Path(path).is_dir()
    fs, p = filesystem(path)
    return fs.isdir(p)


def isfile(path: Location) -> bool:
    if not has_scheme(path):
        return Path(path).is_file()
    fs, p = filesystem(path)
    return fs.isfile(p)


def makedirs(path: Location) -> None:
    if not has_scheme(path):
        return Path(path).mkdir(parents=True, exist_ok=True)
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)


def open_file(path: Location, mode: str = "rb") -> IO[Any]:
    if not has_scheme(path):
        return open(path, mode)  # noqa: SIM115  (the caller's with-block closes it)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def files_in(path: Location) -> list[str]:
    """The names of the files (not folders) directly in folder ``path``."""
    if not has_scheme(path):
        return [p.name for p in Path(path).iterdir() if p.is_file()]
    fs, p = filesystem(path)
    return [posixpath.basename(e["name"].rstrip("/")) for e in fs.ls(p, detail=True) if e["type"] == "file"]


def remove(path: Location) -> None:
    """Remove a file or a folder with everything in it; nothing there is fine."""
    if not has_scheme(path):
        path = Path(path)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def move(source: Location, target: Location) -> None:
    """Rename ``source`` (a file or folder) to ``target``, which must not exist (atomic on a local disk)."""
    if not has_scheme(source):
        Path(source).rename(target)
        return
    fs, p = filesystem(source)
    fs.mv(p, filesystem(target)[1], recursive=True)


def link_or_copy(source: Location, target: Location) -> None:
    """``target`` as a hard link to ``source`` on a local disk; a copy where there are no links."""
    if not has_scheme(source):
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        return
    fs, p = filesystem(source)
    fs.copy(p, filesystem(target)[1])


def storage_writer(path: Location) -> Any:
    """torch's DCP writer for a folder: one file per rank."""
    from torch.distributed.checkpoint import FileSystemWriter  # noqa: PLC0415

    if not has_scheme(path):
        return FileSystemWriter(path, single_file_per_rank=True)
    return FsspecWriter(str(path), single_file_per_rank=True)
