"""DPO's preference data: TRL's formats tokenized as TRL's own ``DPOTrainer._prepare_dataset`` tokenizes them (text
with EOS, explicit-prompt conversations, implicit-prompt conversations), pairs read as (2, seq_len) rows with labels
on the answers only, truncation counted and warned once, and bad input refused with the columns found."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
from test_text_data import _bpe, _save_tokenizer

from lightning_parallel.preference.data import (
    PreferencePairs,
    PreferenceSettings,
    build_preference_cache,
    tokenize_pair,
)
from lightning_parallel.text import load_tokenizer

TEXT = [
    {"prompt": "open the file?", "chosen": " read it", "rejected": " write a class module"},
    {"prompt": "name a loop", "chosen": " for", "rejected": " return yield"},
]
CHATS = [
    {
        "prompt": [{"role": "user", "content": r["prompt"]}],
        "chosen": [{"role": "assistant", "content": r["chosen"]}],
        "rejected": [{"role": "assistant", "content": r["rejected"]}],
    }
    for r in TEXT
]
IMPLICIT = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CHATS]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(None, _save_tokenizer(_bpe(), tmp_path_factory.mktemp("bpe")))[0]


def _write(folder, rows, name="pairs.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _trl_tokenized(rows, tokenizer):
    """TRL's own preprocessing (``DPOTrainer._prepare_dataset``) of the rows: prompt, chosen and rejected ids."""
    import datasets
    from trl.trainer.dpo_trainer import DPOTrainer

    trainer = SimpleNamespace(_tokenizer=tokenizer.backend)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    out = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer.backend, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in out]


@pytest.mark.parametrize("rows", [TEXT, CHATS, IMPLICIT], ids=["text", "conversations", "implicit prompt"])
def test_pairs_tokenized_as_trl(rows, tokenizer, tmp_path):
    pytest.importorskip("trl")
    folder = build_preference_cache(PreferenceSettings(_write(tmp_path, rows), seq_len=64), tokenizer, tmp_path / "c")
    pairs = PreferencePairs(folder, 64)
    assert len(pairs) == len(rows)
    for i, (prompt, chosen, rejected) in enumerate(_trl_tokenized(rows, tokenizer)):
        item = pairs[i]
        assert item["input_ids"].shape == (2, 64)
        for side, answer in enumerate((chosen, rejected)):
            n = len(prompt) + len(answer)
            assert item["input_ids"][side, :n].tolist() == prompt + answer
            assert item["labels"][side, : len(prompt)].eq(-100).all()
            assert item["labels"][side, len(prompt) : n].tolist() == answer  # the answer only: EOS included
            assert item["labels"][side, n:].eq(-100).all() and item["attention_mask"][side].sum() == n


def test_truncation_counted_and_warned_once(tokenizer, tmp_path):
    rows = [*TEXT, {"prompt": "list " * 30, "chosen": " a", "rejected": " b"}]  # the last prompt fills seq_len
    sizes = [[len(ids) for ids in tokenize_pair(tokenizer, r["prompt"], r["chosen"], r["rejected"])] for r in TEXT]
    seq = max(p + max(c, r) for p, c, r in sizes) - 1  # the longest pair is cut, its prompt fits
    cut = sum(p + max(c, r) > seq for p, c, r in sizes)
    assert 0 < cut
    settings = PreferenceSettings(_write(tmp_path, rows), seq_len=seq)
    match = rf"{cut} of 3 pairs are longer than model.seq_len={seq} and were cut to it; 1 pairs whose prompt"
    with pytest.warns(UserWarning, match=match):
        folder = build_preference_cache(settings, tokenizer, tmp_path / "c")
    pairs = PreferencePairs(folder, seq)
    assert len(pairs) == 2 and all(pairs[i]["labels"][:, 1:].ne(-100).any(dim=1).all() for i in range(2))
    with warnings.catch_warnings(record=True) as again:  # the built cache reused: the same one warning
        warnings.simplefilter("always")
        build_preference_cache(settings, tokenizer, tmp_path / "c")
    assert len([w for w in again if "longer than" in str(w.message)]) == 1


def test_missing_columns_listed(tokenizer, tmp_path):
    rows = [{"prompt": "a", "chosen": "b", "answer": "c"}]
    with pytest.raises(ValueError, match=r"the files hold \['prompt', 'chosen', 'answer'\]: missing \['rejected'\]"):
        build_preference_cache(PreferenceSettings(_write(tmp_path, rows), 16), tokenizer, tmp_path / "c")


def test_pair_with_different_prompts_refused(tokenizer, tmp_path):
    rows = [*IMPLICIT, {"chosen": CHATS[0]["prompt"] + CHATS[0]["chosen"], "rejected": CHATS[1]["prompt"] + []}]
    rows[-1]["rejected"] = CHATS[1]["prompt"] + CHATS[1]["rejected"]
    with pytest.raises(ValueError, match="row 2's chosen and rejected conversations have different prompts"):
        build_preference_cache(PreferenceSettings(_write(tmp_path, rows), 32), tokenizer, tmp_path / "c")


def test_text_without_prompt_column_refused(tokenizer, tmp_path):
    rows = [{"chosen": "a b", "rejected": "a c"}]
    with pytest.raises(ValueError, match="without a 'prompt' column needs whole conversations"):
        build_preference_cache(PreferenceSettings(_write(tmp_path, rows), 32), tokenizer, tmp_path / "c")
