"""Preference pairs from local files (json, jsonl, parquet, csv through ``datasets``) in TRL's preference formats,
tokenized once into a token cache and read by every rank as (chosen, rejected) pairs.

Formats (TRL's ``DPOTrainer._prepare_dataset``, trl 1.16 lines 1036-1140):

- explicit prompt, text: ``prompt``, ``chosen``, ``rejected`` strings; EOS appended to each answer;
- explicit prompt, conversations: ``prompt`` a list of messages, ``chosen`` / ``rejected`` the assistant's turns;
  rendered with the tokenizer's chat template (the prompt with the generation prompt);
- implicit prompt, conversations: ``chosen`` / ``rejected`` whole conversations whose messages before the last are
  the prompt (TRL's ``extract_prompt``): they must agree, else the pair is refused;
- with LitGPT's tokenizer (a prompt style, no chat template): single-turn conversations read as text, the prompt
  written in the prompt style (:func:`.litgpt.single_turn_text`).

An answer starts where the tokenized prompt and the tokenized prompt + answer diverge (TRL's
``common_prefix_length``). A pair is cut to ``seq_len`` tokens per side from the start (TRL's ``keep_start``): the
pairs cut are counted and warned about once; pairs whose prompt fills ``seq_len`` (no answer token left) are dropped,
counted and warned about (TRL drops them too).

The cache (``meta.json`` written last, in a folder renamed into place): ``ids.bin`` with both sequences of every
pair one after the other (chosen first), ``loss.bin`` 1 on answer tokens, ``offsets.npy`` (sequence ``s`` is
``ids[offsets[s]:offsets[s + 1]]``, pair ``i`` is sequences ``2i`` and ``2i + 1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_parallel.preference.litgpt import single_turn_text
from lightning_parallel.text.cache import token_dtype
from lightning_parallel.text.files import data_files, file_format, files_digest, load_rows
from lightning_parallel.text.tokenizer import TextTokenizer

CACHE_VERSION = 1
META, IDS, LOSS, OFFSETS = "meta.json", "ids.bin", "loss.bin", "offsets.npy"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class PreferenceSettings:
    """The preference data's settings (the DPO recipe's ``data.*``).

    Args:
        path: a local file, a folder of files or a glob (json, jsonl, parquet, csv).
        seq_len: tokens per sequence (prompt and answer); longer ones are cut (counted, warned once).
        format: the files' format; None: from their suffix.
        prompt_column, chosen_column, rejected_column: the columns read.
    """

    path: str
    seq_len: int
    format: str | None = None
    prompt_column: str = "prompt"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"


def _conversational(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_preference_columns(found: list[str], s: PreferenceSettings) -> bool:
    """Whether the rows name their prompt (explicit) or not (implicit: conversations).

    Raises:
        ValueError: the chosen or rejected column missing; the columns found listed.
    """
    wanted = [s.chosen_column, s.rejected_column]
    missing = [c for c in wanted if c not in found]
    if missing:
        raise ValueError(
            f"data=preference needs the columns {[s.prompt_column, *wanted]} (TRL's preference format; the prompt "
            f"may be left out when chosen and rejected are whole conversations), but the files hold {found}: missing "
            f"{missing}. Rename the columns, or name them with data.prompt_column / data.chosen_column / "
            "data.rejected_column."
        )
    return s.prompt_column in found


def split_implicit(chosen: list[dict], rejected: list[dict], index: int) -> tuple[list, list, list]:
    """(prompt, chosen answer, rejected answer) of two whole conversations: the messages before the last.

    Raises:
        ValueError: the two prompts differ (the pair is not one prompt's two answers), naming the row.
    """
    if chosen[:-1] != rejected[:-1]:
        raise ValueError(
            f"data=preference: row {index}'s chosen and rejected conversations have different prompts (the messages "
            f"before the last: {chosen[:-1]!r} vs {rejected[:-1]!r}): a pair must answer one prompt. Fix the row, or "
            "give the prompt in its own column."
        )
    return chosen[:-1], chosen[-1:], rejected[-1:]


def tokenize_pair(tokenizer: TextTokenizer, prompt: Any, chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """(prompt ids, chosen answer ids, rejected answer ids) as TRL tokenizes a pair (see the module docstring).

    Raises:
        ValueError: conversations and a tokenizer without a chat template; a prompt and answers of mixed kinds.
    """
    kinds = {_conversational(v) for v in (prompt, chosen, rejected)}
    if len(kinds) > 1:
        raise ValueError(
            "data=preference: a row mixes text and conversations in prompt / chosen / rejected: give all three as "
            "text, or all three as lists of {'role', 'content'} messages."
        )
    if kinds == {True} and not tokenizer.has_chat_template and tokenizer.prompt_style is not None:
        prompt, chosen, rejected = single_turn_text(prompt, chosen, rejected)  # LitGPT's: text in its prompt style
        kinds = {False}
    if kinds == {True}:
        if not tokenizer.has_chat_template:
            raise ValueError(
                f"data=preference holds conversations but the tokenizer {tokenizer.source!r} has no chat template: "
                "give one (data.chat_template=FILE) or a tokenizer with one (data.tokenizer=FOLDER), or text columns."
            )
        texts = [
            tokenizer.render_chat(prompt, add_generation_prompt=True),
            tokenizer.render_chat(prompt + chosen, add_generation_prompt=False),
            tokenizer.render_chat(prompt + rejected, add_generation_prompt=False),
        ]
        p, pc, pr = tokenizer.encode(texts, special=False)
    else:
        eos = tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else ""
        ended = [a if a.endswith(eos) else a + eos for a in (str(chosen), str(rejected))]
        head = tokenizer.render_prompt(str(prompt))
        p, pc, pr = tokenizer.encode([head, head + ended[0], head + ended[1]])
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    return p[:n], pc[n:], pr[n:]


def cache_folder(settings: PreferenceSettings, tokenizer: TextTokenizer, cache_dir: str | Path) -> Path:
    """Where the cache of these files, tokenizer and settings lies (a hash of all three names it)."""
    files = data_files(settings.path)
    fields = {**asdict(settings), "path": files_digest(files), "version": CACHE_VERSION}
    fields["tokenizer"] = tokenizer.fingerprint()
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir).expanduser() / f"preference-{key[:24]}"


def build_preference_cache(settings: PreferenceSettings, tokenizer: TextTokenizer, cache_dir: str | Path) -> Path:
    """The token cache of the pairs in ``settings.path``: reused when built before, else built (in the parent
    process, before any worker starts). Truncated and dropped pairs are warned about once, here. Returns its folder.

    Raises:
        ValueError: missing columns (those found listed), a pair whose prompts differ, no pair left.
        FileNotFoundError: ``settings.path`` names no file.
    """
    folder = cache_folder(settings, tokenizer, cache_dir)
    if not (folder / META).is_file():
        _build(folder, settings, tokenizer)
    meta = json.loads((folder / META).read_text())
    if meta["truncated"] or meta["dropped"]:
        warnings.warn(
            f"data=preference: {meta['truncated']} of {meta['rows']} pairs are longer than model.seq_len="
            f"{settings.seq_len} and were cut to it; {meta['dropped']} pairs whose prompt fills it were left out: "
            "raise model.seq_len or shorten those pairs.",
            stacklevel=2,
        )
    return folder


def _rows(settings: PreferenceSettings, tmp: Path) -> tuple[Any, bool]:
    files = data_files(settings.path)
    rows = load_rows(files, file_format(files, settings.format), "paragraph", tmp / "hf")
    return rows, check_preference_columns(list(rows.column_names), settings)


def _tokenize_rows(rows: Any, explicit: bool, s: PreferenceSettings, tokenizer: TextTokenizer) -> dict[str, Any]:
    """Every pair's two sequences (prompt + answer, cut to ``seq_len``) and loss masks, flattened; the counts."""
    seq = s.seq_len
    out: dict[str, Any] = {"ids": [], "loss": [], "lengths": [], "truncated": 0, "dropped": 0}
    for index, row in enumerate(rows):
        chosen, rejected = row[s.chosen_column], row[s.rejected_column]
        if explicit:
            prompt = row[s.prompt_column]
        elif _conversational(chosen) and _conversational(rejected):
            prompt, chosen, rejected = split_implicit(chosen, rejected, index)
        else:
            raise ValueError(
                f"data=preference without a {s.prompt_column!r} column needs whole conversations in "
                f"{s.chosen_column!r} and {s.rejected_column!r} (row {index} is text): add the prompt column."
            )
        p, c, r = tokenize_pair(tokenizer, prompt, chosen, rejected)
        if len(p) >= seq:
            out["dropped"] += 1
            continue
        out["truncated"] += int(len(p) + max(len(c), len(r)) > seq)
        for answer in (c, r):
            sample = (p + answer)[:seq]
            out["ids"] += sample
            out["loss"] += ([0] * len(p) + [1] * len(answer))[:seq]
            out["lengths"].append(len(sample))
    if not out["lengths"]:
        raise ValueError(
            f"data.path={s.path!r}: no pair has an answer token within model.seq_len={seq}: raise model.seq_len."
        )
    return out


def _build(folder: Path, settings: PreferenceSettings, tokenizer: TextTokenizer) -> None:
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        rows, explicit = _rows(settings, tmp)
        out = _tokenize_rows(rows, explicit, settings, tokenizer)
        dtype = token_dtype(tokenizer.vocab_size)
        np.asarray(out["ids"], dtype=dtype).tofile(tmp / IDS)
        np.asarray(out["loss"], dtype=np.uint8).tofile(tmp / LOSS)
        np.save(tmp / OFFSETS, np.concatenate([[0], np.cumsum(out["lengths"])]).astype(np.int64))
        meta = {"version": CACHE_VERSION, "kind": "preference", "dtype": dtype.name, "rows": len(rows)}
        meta.update(pairs=len(out["lengths"]) // 2, tokens=len(out["ids"]))
        meta.update(truncated=out["truncated"], dropped=out["dropped"], seq_len=settings.seq_len)
        meta.update(pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, tokenizer=tokenizer.source)
        meta.update(explicit_prompt=explicit, files=[str(f) for f in data_files(settings.path)])
        del rows
        shutil.rmtree(tmp / "hf", ignore_errors=True)
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process built the same cache first
            if not (folder / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class PreferencePairs(Dataset):
    """The pairs of a built cache: item ``i`` is a dict of (2, seq_len) int64 tensors, row 0 the chosen sequence and
    row 1 the rejected one, padded on the right: ``input_ids``, ``labels`` (the ids on answer tokens, else -100),
    ``attention_mask`` (unless ``attention_mask=False``: a model that takes none, LitGPT's GPT); with reference
    log-probabilities computed before training (:meth:`with_reference`), ``reference_logps`` (2,) float32.

    Args:
        folder: the cache's folder (:func:`build_preference_cache`).
        seq_len: the row length (at least the cache's).
        attention_mask: whether rows carry one.
    """

    def __init__(self, folder: str | Path, seq_len: int, attention_mask: bool = True) -> None:
        folder = Path(folder)
        if not (folder / META).is_file():
            raise FileNotFoundError(f"{folder} holds no preference cache: build it first (build_preference_cache).")
        self.meta = json.loads((folder / META).read_text())
        if self.meta["seq_len"] > seq_len:
            longest = self.meta["seq_len"]
            raise ValueError(f"the cache {folder} holds sequences of {longest} tokens > seq_len={seq_len}.")
        self.ids = np.memmap(folder / IDS, dtype=np.dtype(self.meta["dtype"]), mode="r")
        self.loss = np.memmap(folder / LOSS, dtype=np.uint8, mode="r")
        self.offsets = np.load(folder / OFFSETS, mmap_mode="r")
        self.seq_len, self.attention_mask, self.pad_id = seq_len, attention_mask, self.meta["pad_id"]
        self.reference: Tensor | None = None

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 2

    def with_reference(self, logps: Tensor) -> PreferencePairs:
        """These pairs carrying ``logps`` (len, 2): the reference's summed answer log-probabilities."""
        assert logps.shape == (len(self), 2), (logps.shape, len(self))
        self.reference = logps.float()
        return self

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = np.full((2, self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((2, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((2, self.seq_len), dtype=np.int64)
        for side in (0, 1):
            start, end = self.offsets[2 * i + side], self.offsets[2 * i + side + 1]
            n = end - start
            ids[side, :n] = self.ids[start:end]
            labels[side, :n] = np.where(self.loss[start:end] > 0, ids[side, :n], IGNORE_INDEX)
            mask[side, :n] = 1
        item = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.attention_mask:
            item["attention_mask"] = torch.from_numpy(mask)
        if self.reference is not None:
            item["reference_logps"] = self.reference[i]
        return item
