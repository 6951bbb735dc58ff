"""Token data made on the spot: no download, same on every machine, and learnable."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """Sequences that follow a fixed random bigram table with a little noise.

    A model that learns the table drives the loss well below ``log(vocab_size)``, so training progress is
    visible within a few steps; ``seed`` makes the data identical in every process.

    Args:
        num_samples: number of sequences.
        seq_len: tokens per input sequence (targets are the inputs shifted by one).
        vocab_size: token ids are in ``[0, vocab_size)``.
        noise: probability that a token is drawn at random instead of from the table.
        seed: seed of the table (the "language"); splits of one language share it.
        split: 0 for training, 1 for validation, ...: draws other sequences from the same table.
    """

    def __init__(
        self,
        num_samples: int = 512,
        seq_len: int = 32,
        vocab_size: int = 256,
        noise: float = 0.1,
        seed: int = 0,
        split: int = 0,
    ) -> None:
        table = torch.randint(vocab_size, (vocab_size,), generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed * 1_000_003 + split + 1)
        tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (num_samples,), generator=g)
        for t in range(1, seq_len + 1):
            random = torch.randint(vocab_size, (num_samples,), generator=g)
            keep = torch.rand(num_samples, generator=g) >= noise
            tokens[:, t] = torch.where(keep, table[tokens[:, t - 1]], random)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]
