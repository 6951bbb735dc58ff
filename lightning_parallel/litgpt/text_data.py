"""Local text as LitGPT pretraining data, one map-style block at a time: for ``litgpt.pretrain`` under any layout.

LitGPT's own pretraining data modules (``TextFiles``, ``TinyStories``, ``TinyLlama``) stream through ``litdata``,
whose ``StreamingDataset`` hands each *process* of the world its own part of the data: under tensor (or context,
pipeline) parallelism the ranks that must see one batch would each get a different one. :class:`TextBlocks` is a
plain ``DataLoader`` over token blocks instead, so Fabric's ``setup_dataloaders`` gives it the strategy's
data-parallel sampler (every tp peer the same batches), and its loader is Stateful: the script's
``fabric.save(..., {"train_dataloader": ...})`` records how far it got and its ``resume`` carries on with the next
batch, as an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from litgpt.data import DataModule
from litgpt.tokenizer import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """A ``DataLoader`` (in order, no shuffling) that a checkpoint resumes mid-pass: its state is how many batches of
    the current pass it has handed out; after ``load_state_dict`` the next pass skips that many."""

    _served = 0
    _skip = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        self._served = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self._served += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["served"])


@dataclass
class TextBlocks(DataModule):
    """The ``.txt`` files of a folder, tokenized (each file ended by EOS, begun by BOS where the tokenizer adds one),
    joined and cut into blocks of ``max_seq_length + 1`` tokens (the pretraining script's inputs and shifted targets).

    Args:
        train_data_path: the folder of ``.txt`` files (read in name order).
        val_blocks: how many of the last blocks are the validation set (at least 1).
    """

    train_data_path: Path
    val_blocks: int = 2
    tokenizer: Tokenizer | None = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)
    blocks: list[Tensor] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()
        if self.val_blocks < 1:
            raise ValueError(f"TextBlocks(val_blocks={self.val_blocks}): the script validates; give val_blocks >= 1.")

    def connect(
        self, tokenizer: Tokenizer | None = None, batch_size: int = 1, max_seq_length: int | None = None, **_: Any
    ) -> None:
        if tokenizer is None or max_seq_length is None:
            raise ValueError("TextBlocks needs the tokenizer and max_seq_length: pass the script's tokenizer_dir.")
        self.tokenizer, self.batch_size, self.max_seq_length = tokenizer, batch_size, max_seq_length

    def setup(self, stage: str = "") -> None:
        assert self.tokenizer is not None
        files = sorted(Path(self.train_data_path).glob("*.txt"))
        tokens = torch.cat([self.tokenizer.encode(f.read_text(), eos=True) for f in files] or [torch.ones(0)])
        size = self.max_seq_length + 1
        self.blocks = list(tokens[: len(tokens) // size * size].long().view(-1, size))
        if len(self.blocks) <= self.val_blocks:
            raise ValueError(
                f"TextBlocks: {self.train_data_path} makes {len(self.blocks)} blocks of {size} tokens, not more than "
                f"val_blocks={self.val_blocks}: add text or lower max_seq_length."
            )

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self.blocks[: -self.val_blocks], batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.blocks[-self.val_blocks :], batch_size=self.batch_size, shuffle=False)
