"""The token cache: every sample's ids in one memory-mapped file (uint16 when the vocabulary fits, else uint32),
an ``sft`` loss mask and sample offsets beside it, and ``meta.json``. Keyed by a hash of the files (paths, sizes,
modification times), the tokenizer (:meth:`TextTokenizer.fingerprint`) and the settings; built once, tokenized
through ``datasets.map`` (``num_proc`` processes), in a temporary folder renamed into place when complete, so a
reader never sees half a cache; then read, memory-mapped, by every rank (:func:`open_token_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_parallel.text.files import check_columns, data_files, file_format, files_digest, load_rows
from lightning_parallel.text.samples import TextDataSettings, tokenize_function
from lightning_parallel.text.tokenizer import TextTokenizer

CACHE_VERSION = 1  # bump when the layout or the tokenization rules change: old caches are then not reused
META = "meta.json"  # written last: a folder with it is complete
IDS, LOSS, OFFSETS = "ids.bin", "loss.bin", "offsets.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary up to 65,536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass
class TokenCache:
    """A built cache, memory-mapped read-only.

    Attributes:
        folder: where it lies.
        ids: every sample's (``sft``) or document's (``hf_text``) token ids, one after the other.
        loss: ``sft``: 1 where the token is trained on (the answers), else 0; None for ``hf_text``.
        offsets: ``sft``: sample i is ``ids[offsets[i]:offsets[i + 1]]``; None for ``hf_text``.
        meta: what ``meta.json`` says (counts, dtype, the tokenizer's eos and pad ids, the columns read, the build's
            time and throughput: ``build_seconds``, ``tokens_per_second``).
    """

    folder: Path
    ids: np.ndarray
    loss: np.ndarray | None
    offsets: np.ndarray | None
    meta: dict[str, Any]


def cache_key(settings: TextDataSettings, files: list[Path], fmt: str, tokenizer: TextTokenizer) -> str:
    """The hash naming a cache: the files, the tokenizer and every setting the ids depend on."""
    fields = asdict(settings)
    for unused in ("path", "num_proc", "packing"):  # files_digest covers the path; the rest do not change the ids
        fields.pop(unused)
    if settings.kind == "hf_text":
        fields.pop("seq_len")  # documents are cut into blocks when read: one cache serves every seq_len
    parts = {"version": CACHE_VERSION, "files": files_digest(files), "format": fmt}
    parts["tokenizer"] = tokenizer.fingerprint()
    return hashlib.sha256(json.dumps({**parts, **fields}, sort_keys=True).encode()).hexdigest()


def build_token_cache(settings: TextDataSettings, tokenizer: TextTokenizer, cache_dir: str | Path) -> TokenCache:
    """The token cache for ``settings``: reused when one with the same key exists, else built (once: call it in
    the parent process before the workers start; the workers open its folder with :func:`open_token_cache`).
    Samples cut to ``seq_len`` are counted and warned about once, here.

    Args:
        settings: the data settings.
        tokenizer: the tokenizer (:func:`~lightning_parallel.text.load_tokenizer`).
        cache_dir: the folder holding the caches (one subfolder each).

    Raises:
        ValueError: missing columns (those found listed), chat data and no chat template, no data.
        FileNotFoundError: ``settings.path`` names no file.
    """
    files = data_files(settings.path)
    fmt = file_format(files, settings.format)
    key = cache_key(settings, files, fmt, tokenizer)
    folder = Path(cache_dir).expanduser() / f"{settings.kind}-{key[:24]}"
    if not (folder / META).is_file():
        _build(folder, settings, files, fmt, tokenizer, key)
    cache = open_token_cache(folder)
    _warn_truncated(cache.meta)
    return cache


def open_token_cache(folder: str | Path) -> TokenCache:
    """A built cache, memory-mapped read-only (what each rank does).

    Raises:
        FileNotFoundError: no complete cache in ``folder``.
    """
    folder = Path(folder)
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{folder} holds no token cache: build it first (build_token_cache).")
    meta = json.loads((folder / META).read_text())
    ids = np.memmap(folder / IDS, dtype=np.dtype(meta["dtype"]), mode="r")
    sft = meta["kind"] == "sft"
    loss = np.memmap(folder / LOSS, dtype=np.uint8, mode="r") if sft else None
    offsets = np.load(folder / OFFSETS, mmap_mode="r") if sft else None
    return TokenCache(folder, ids, loss, offsets, meta)


def _build(
    folder: Path, settings: TextDataSettings, files: list[Path], fmt: str, tokenizer: TextTokenizer, key: str
) -> None:
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        started = time.perf_counter()
        rows = load_rows(files, fmt, settings.sample_by, tmp / "hf")
        columns = check_columns(rows.column_names, settings.kind, settings.column_options())
        function, kwargs = tokenize_function(settings, columns, tokenizer)
        tokens = rows.map(
            function,
            fn_kwargs=kwargs,
            batched=True,
            batch_size=256,
            num_proc=settings.num_proc if settings.num_proc > 1 else None,
            remove_columns=rows.column_names,
            new_fingerprint=key[:40],  # no hashing of the tokenizer: the key says it all (datasets takes 64 chars)
            load_from_cache_file=False,
            desc=f"tokenizing {settings.path}",
        )
        meta = _write(tmp, tokens, settings, tokenizer)
        seconds = time.perf_counter() - started  # reading, tokenizing and writing: what a first run waits for
        meta.update(files=[str(f) for f in files], format=fmt, columns=columns, tokenizer=tokenizer.source)
        meta.update(build_seconds=round(seconds, 3), tokens_per_second=round(meta["tokens"] / seconds))
        del rows, tokens
        shutil.rmtree(tmp / "hf")  # the Arrow copies: the cache is the memory map
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)  # atomic: the cache appears whole
        except OSError:  # another process renamed its own build there first: the same content
            if not (folder / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(tmp: Path, tokens: Any, settings: TextDataSettings, tokenizer: TextTokenizer) -> dict[str, Any]:
    """The mapped rows' ids (and loss masks) written into memory-mapped files; the counts for ``meta.json``."""
    import pyarrow.compute as pc

    table = tokens.data.table
    chunks = table.column("ids").chunks if "ids" in table.column_names else []  # no rows left: no columns either
    lengths = np.concatenate([pc.list_value_length(c).to_numpy() for c in chunks] or [np.zeros(0, np.int64)])
    total = int(lengths.sum())
    if total == 0:
        raise ValueError(
            f"data.path={settings.path!r}: the {settings.kind} rows hold no text to train on: give files with text."
        )
    dtype = token_dtype(tokenizer.vocab_size)
    _fill(tmp / IDS, dtype, total, table.column("ids"))
    meta = {"version": CACHE_VERSION, "kind": settings.kind, "dtype": dtype.name, "tokens": total}
    meta.update(samples=len(lengths), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    if settings.kind == "sft":
        loss = _fill(tmp / LOSS, np.dtype(np.uint8), total, table.column("loss"))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.save(tmp / OFFSETS, offsets)
        trained = np.concatenate([[0], np.cumsum(loss, dtype=np.int64)])[offsets]  # answer tokens before each sample
        truncated = int(pc.sum(table.column("truncated")).as_py() or 0)
        meta.update(seq_len=settings.seq_len, truncated=truncated, no_answer=int((np.diff(trained) == 0).sum()))
    return meta


def _fill(path: Path, dtype: np.dtype, total: int, column: Any) -> np.ndarray:
    """The flattened list ``column`` written to a new memory-mapped file of ``total`` items; returned in memory."""
    out = np.memmap(path, dtype=dtype, mode="w+", shape=(total,))
    at = 0
    for chunk in column.chunks:
        values = chunk.flatten().to_numpy()
        out[at : at + len(values)] = values
        at += len(values)
    assert at == total, (at, total)
    out.flush()
    return np.asarray(out)


def _warn_truncated(meta: dict[str, Any]) -> None:
    """One warning for all the samples cut to seq_len (and those left with no answer token)."""
    if meta.get("truncated") or meta.get("no_answer"):
        warnings.warn(
            f"data=sft: {meta['truncated']} of {meta['samples']} samples are longer than seq_len={meta['seq_len']} "
            f"and were cut to it; {meta['no_answer']} samples hold no answer token (nothing to train on): raise "
            "seq_len or shorten those samples.",
            stacklevel=3,
        )
