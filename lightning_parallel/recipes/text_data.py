"""Token data for the GPT recipe: a memory-mapped file of token ids cut into fixed-length windows.

By default the corpus is built on the spot from text every Python installation carries (the reference
documentation behind ``help()``, in ``pydoc_data``), so nothing is downloaded; ``data.path`` takes any
UTF-8 text file (byte tokens) or a pre-tokenized file of uint16 ids.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

DEFAULT_CORPUS = "python_docs.txt"


def write_default_corpus(path: Path) -> Path:
    """The text of Python's own documentation topics (about 0.8 MB), written once to ``path``."""
    if not path.exists():
        from pydoc_data.topics import topics

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one per worker: they may all build it at once
        tmp.write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
        tmp.replace(path)  # atomic: no worker ever reads half a file
    return path


def load_tokens(kind: str, path: str | None, cache_dir: Path) -> np.ndarray:
    """A read-only memory map of the token ids (uint8 bytes for text, uint16 for ``tokens``)."""
    if kind not in ("text", "tokens"):
        raise ValueError(f"data.kind={kind!r} is unknown: use 'text' (a UTF-8 file) or 'tokens' (uint16 ids).")
    if kind == "tokens":
        if path is None:
            raise ValueError("data=tokens needs data.path=FILE, a file of uint16 token ids.")
        return np.memmap(_existing(path), dtype=np.uint16, mode="r")
    source = _existing(path) if path is not None else write_default_corpus(cache_dir / DEFAULT_CORPUS)
    return np.memmap(source, dtype=np.uint8, mode="r")  # UTF-8 bytes are the tokens: vocabulary 256


def _existing(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r} is not a file: give the path of a local text or token file.")
    return p


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: inputs and the next-token targets.

    ``split`` takes the first ``1 - val_fraction`` of the windows ("train") or the rest ("val"). With
    ``labels_are_inputs`` a sample is ``(inputs, inputs)``, for models that shift the labels themselves (HF's).
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, split: str, val_fraction: float, labels_are_inputs: bool = False
    ) -> None:
        windows = (len(tokens) - 1) // seq_len
        n_val = max(1, int(windows * val_fraction))
        if windows - n_val < 1:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, too few for windows of model.seq_len={seq_len}: "
                "use a longer text or a shorter seq_len."
            )
        self.tokens, self.seq_len, self.labels_are_inputs = tokens, seq_len, labels_are_inputs
        self.first, self.count = (0, windows - n_val) if split == "train" else (windows - n_val, n_val)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = (self.first + i) * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return (chunk[:-1], chunk[:-1]) if self.labels_are_inputs else (chunk[:-1], chunk[1:])
