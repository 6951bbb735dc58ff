"""Torch datasets over a token cache, every item a dict of (seq_len,) int64 tensors that
:meth:`HFCausalLM.unpack <lightning_parallel.hf.HFCausalLM.unpack>` reads (torch's default collate stacks them
into (B, seq_len) batches). Labels are the input ids (the loss shifts them), -100 where nothing is learned.

- ``hf_text`` (:class:`TextBlocks`): ``input_ids``, ``labels``: consecutive ``seq_len`` blocks of the documents.
- ``sft``, ``packing=False`` (:class:`PaddedSamples`): one sample per row, padded on the right: ``input_ids``,
  ``labels`` (-100 on the prompt and the padding), ``attention_mask`` (1 on the sample, 0 on the padding).
- ``sft``, ``packing=True`` (:class:`PackedSamples`): whole samples, in order, as many as fit in a row:
  ``input_ids``, ``labels`` (-100 on prompts, padding and each sample's first token, which nothing before it in
  that sample predicts), ``position_ids`` (0, 1, ... restarting at each sample: transformers' attention masks
  find the samples from them, so no token attends across samples) and ``document_ids`` (0, 1, ... per sample; the
  padding at the end of a row is one more segment, positions restarting too).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_parallel.causal_lm import IGNORE_INDEX
from lightning_parallel.text.cache import TokenCache


def _tensor(values: np.ndarray) -> Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


class TextBlocks(Dataset):
    """``hf_text``: the documents (EOS after each) cut into consecutive blocks of ``seq_len`` tokens; the tail
    shorter than a block is left out.

    Args:
        cache: an ``hf_text`` token cache.
        seq_len: tokens per block.
    """

    def __init__(self, cache: TokenCache, seq_len: int) -> None:
        self.ids, self.seq_len = cache.ids, seq_len
        self.blocks = len(cache.ids) // seq_len
        if self.blocks == 0:
            raise ValueError(
                f"data=hf_text: the documents hold {len(cache.ids)} tokens, fewer than one block of "
                f"seq_len={seq_len}: give more text or a shorter seq_len."
            )

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = _tensor(self.ids[i * self.seq_len : (i + 1) * self.seq_len])
        return {"input_ids": ids, "labels": ids.clone()}


class _Samples(Dataset):
    """The ``sft`` samples of a cache: ids, and labels that are the ids where the loss mask is 1."""

    def __init__(self, cache: TokenCache, seq_len: int) -> None:
        if cache.offsets is None or cache.loss is None:
            raise ValueError(f"{cache.folder} is a {cache.meta['kind']} cache, not an sft one: build it with kind=sft.")
        if cache.meta["seq_len"] > seq_len:
            raise ValueError(
                f"the cache {cache.folder} holds samples of up to {cache.meta['seq_len']} tokens, longer than "
                f"seq_len={seq_len}: build the cache with this seq_len."
            )
        self.cache, self.seq_len, self.pad_id = cache, seq_len, cache.meta["pad_id"]
        self.lengths = np.diff(cache.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of sample i."""
        start, end = self.cache.offsets[i], self.cache.offsets[i + 1]
        ids = np.asarray(self.cache.ids[start:end], dtype=np.int64)
        return ids, np.where(self.cache.loss[start:end] > 0, ids, IGNORE_INDEX)

    def _row(self) -> tuple[np.ndarray, np.ndarray]:
        return np.full(self.seq_len, self.pad_id, dtype=np.int64), np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)


class PaddedSamples(_Samples):
    """``sft``, ``packing=False``: sample i padded on the right to ``seq_len``, with its attention mask.

    Args:
        cache: an ``sft`` token cache (built with this ``seq_len`` or a shorter one).
        seq_len: the row length.
        attention_mask: False leaves the mask out, for a model that takes none (LitGPT's GPT): its causal attention
            keeps each sample's tokens from the padding after them, whose labels are -100.
    """

    def __init__(self, cache: TokenCache, seq_len: int, attention_mask: bool = True) -> None:
        super().__init__(cache, seq_len)
        self.attention_mask = attention_mask

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids, labels = self._row()
        sample_ids, sample_labels = self.sample(i)
        n = len(sample_ids)
        ids[:n], labels[:n] = sample_ids, sample_labels
        row = {"input_ids": _tensor(ids), "labels": _tensor(labels)}
        if self.attention_mask:
            row["attention_mask"] = _tensor((np.arange(self.seq_len) < n).astype(np.int64))
        return row


def pack_rows(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Samples in order, greedily, as many whole ones per row as fit in ``seq_len``: row r holds samples
    ``starts[r]`` to ``starts[r + 1] - 1`` of the returned ``starts`` (one entry more than there are rows)."""
    starts, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len and used > 0:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


class PackedSamples(_Samples):
    """``sft``, ``packing=True``: whole samples packed into rows of ``seq_len`` (:func:`pack_rows`), each with its
    own position ids and document id, so that no token attends to, or is predicted from, another sample.

    Args:
        cache: an ``sft`` token cache (built with this ``seq_len`` or a shorter one).
        seq_len: the row length.
    """

    def __init__(self, cache: TokenCache, seq_len: int) -> None:
        super().__init__(cache, seq_len)
        self.starts = pack_rows(self.lengths, seq_len)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, r: int) -> dict[str, Tensor]:
        ids, labels = self._row()
        positions, documents = np.zeros(self.seq_len, np.int64), np.zeros(self.seq_len, np.int64)
        at = 0
        for doc, i in enumerate(range(self.starts[r], self.starts[r + 1])):
            sample_ids, sample_labels = self.sample(i)
            n = len(sample_ids)
            ids[at : at + n], labels[at : at + n] = sample_ids, sample_labels
            labels[at] = IGNORE_INDEX  # the previous sample's last token must not learn to predict this one
            positions[at : at + n], documents[at : at + n] = np.arange(n), doc
            at += n
        positions[at:] = np.arange(self.seq_len - at)  # the padding: one more segment of its own
        documents[at:] = self.starts[r + 1] - self.starts[r]
        return {
            "input_ids": _tensor(ids),
            "labels": _tensor(labels),
            "position_ids": _tensor(positions),
            "document_ids": _tensor(documents),
        }


def text_dataset(cache: TokenCache, seq_len: int, packing: bool = False, attention_mask: bool = True) -> Dataset:
    """The dataset a cache's kind calls for (see the module's docstring).

    Args:
        cache: a token cache (:func:`~lightning_parallel.text.build_token_cache` or ``open_token_cache``).
        seq_len: tokens per row.
        packing: ``sft``: pack samples (True) or pad each (False); ignored by ``hf_text``.
        attention_mask: ``sft`` padded: with the attention mask (False: without, see :class:`PaddedSamples`).
    """
    if cache.meta["kind"] == "hf_text":
        return TextBlocks(cache, seq_len)
    return PackedSamples(cache, seq_len) if packing else PaddedSamples(cache, seq_len, attention_mask)
