"""TextBlocks (local text for LitGPT's pretraining script) in one process: the blocks, the split, the refusals, and
its loader resuming mid-pass where a checkpoint left it (what the script's ``fabric.save`` / ``resume`` rely on)."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.litgpt.text_data import ResumableLoader, TextBlocks


class CharTokenizer:
    """Stands in for litgpt's Tokenizer: one id per character, EOS 0."""

    def encode(self, text: str, eos: bool = False) -> torch.Tensor:
        return torch.tensor([ord(c) for c in text] + ([0] if eos else []))


def _data(tmp_path, texts: list[str], seq: int = 3, val_blocks: int = 1) -> TextBlocks:
    for index, text in enumerate(texts):
        (tmp_path / f"{index}.txt").write_text(text)
    data = TextBlocks(tmp_path, val_blocks=val_blocks)
    data.connect(tokenizer=CharTokenizer(), batch_size=2, max_seq_length=seq)
    data.setup()
    return data


def test_text_blocks_cut_the_joined_files_into_blocks(tmp_path):
    data = _data(tmp_path, ["abcdefg", "hijklmnopq"])  # 8 + 11 ids: 4 blocks of 4, 3 ids left over
    tokens = [ord(c) for c in "abcdefg"] + [0] + [ord(c) for c in "hijklmnopq"] + [0]
    assert [b.tolist() for b in data.blocks] == [tokens[i : i + 4] for i in range(0, 16, 4)]
    assert [b.tolist() for b in data.train_dataloader()][0] == [tokens[0:4], tokens[4:8]]
    assert len(list(data.val_dataloader())) == 1


def test_text_blocks_refuse_too_little_text_and_no_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="val_blocks=1"):
        _data(tmp_path, ["abc"])
    with pytest.raises(ValueError, match="tokenizer_dir"):
        TextBlocks(tmp_path).connect(tokenizer=None, max_seq_length=4)
    with pytest.raises(ValueError, match="val_blocks >= 1"):
        TextBlocks(tmp_path, val_blocks=0)


def test_resumable_loader_goes_on_after_the_batches_it_served():
    loader = ResumableLoader(list(range(10)), batch_size=2)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state == {"served": 3} and seen[-1] == [4, 5]
    resumed = ResumableLoader(list(range(10)), batch_size=2)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[6, 7], [8, 9]]
    assert [b.tolist() for b in resumed][0] == [0, 1]  # the next pass starts over
