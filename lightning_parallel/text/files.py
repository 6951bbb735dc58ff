"""Local data files (json, jsonl, parquet, csv, text) read through Hugging Face ``datasets``, never the network:
which files a ``data.path`` names, their format, their rows as a ``datasets.Dataset``, and the columns a data
kind needs checked against those the files hold."""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import Any

# a file's suffix -> the ``datasets`` builder that reads it
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text"}
TEXT_SAMPLE_BY = ("line", "paragraph", "document")  # how a text file is cut into documents (datasets' own names)


def offline_datasets() -> Any:
    """The ``datasets`` module with every hub access off (``HF_DATASETS_OFFLINE``): local files need none, and a
    mistake must fail here rather than reach the network."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is first imported
    import datasets

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # imported before this call
    return datasets


def data_files(path: str | Path) -> list[Path]:
    """The local files ``data.path`` names: a file, a folder (its files of a known suffix, sorted), or a glob.

    Raises:
        FileNotFoundError: nothing there.
    """
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in FORMATS)
    else:
        files = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
    if not files:
        raise FileNotFoundError(
            f"data.path={str(path)!r} names no local file: give a file, a folder or a glob of "
            f"{'/'.join(sorted(set(FORMATS.values())))} files ({', '.join(FORMATS)})."
        )
    return files


def file_format(files: list[Path], fmt: str | None) -> str:
    """The one ``datasets`` builder for ``files``: ``data.format`` when given, else their suffixes'.

    Raises:
        ValueError: an unknown ``data.format``, an unknown suffix, or files of several formats.
    """
    known = sorted(set(FORMATS.values()))
    if fmt is not None:
        if fmt not in known:
            raise ValueError(f"data.format={fmt!r} is unknown: use one of {known} (or null: from the suffix).")
        return fmt
    found = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in found:
        odd = sorted({f.suffix or f.name for f in files if f.suffix.lower() not in FORMATS})
        raise ValueError(f"data.path has files of unknown format ({odd}): set data.format to one of {known}.")
    if len(found) > 1:
        raise ValueError(f"data.path mixes formats {sorted(found)}: keep the files of one format under data.path.")
    return found.pop()


def files_digest(files: list[Path]) -> str:
    """A hash of the files' paths, sizes and modification times: changes whenever one of them is rewritten."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_rows(files: list[Path], fmt: str, sample_by: str, cache_dir: Path) -> Any:
    """The rows of ``files`` as a ``datasets.Dataset`` (Arrow files written under ``cache_dir``).

    Raises:
        ValueError: no rows (``data.path`` named in the message).
    """
    if sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"data.sample_by={sample_by!r} is unknown: use one of {list(TEXT_SAMPLE_BY)}.")
    datasets = offline_datasets()
    empty = ValueError(
        f"data.path={', '.join(map(str, files))} holds no rows: point data.path at files with data in them."
    )
    if all(f.stat().st_size == 0 for f in files):
        raise empty
    kwargs = {"sample_by": sample_by} if fmt == "text" else {}
    try:
        rows = datasets.load_dataset(
            fmt, data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir), **kwargs
        )
    except ValueError as err:  # csv with a header only: "corresponds to no data"
        if "no data" in str(err):
            raise empty from None
        raise
    if len(rows) == 0:
        raise empty
    return rows


def check_columns(found: list[str], kind: str, wanted: list[list[str]]) -> list[str]:
    """The first of the ``wanted`` column sets that ``found`` holds.

    Raises:
        ValueError: none of them there; the message lists the columns found.
    """
    for columns in wanted:
        if all(c in found for c in columns):
            return columns
    options = " or ".join("+".join(repr(c) for c in columns) for columns in wanted)
    raise ValueError(
        f"data={kind} needs the column(s) {options}, but the files hold {found}: rename the columns in the data, "
        "or name them with data.text_column / data.messages_column / data.prompt_column / data.completion_column."
    )
