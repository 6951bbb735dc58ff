"""The text data layer (lightning_parallel/text/): tokenizers from model folders, local files through ``datasets``,
the memory-mapped token cache, the hf_text / sft datasets and their batches. All local, no process group: the
tests build their own BPE tokenizer (with a chat template) on Python's documentation, a 66,000-word one for the
uint32 cache, and write their instruction data as jsonl, parquet and csv."""

from __future__ import annotations

import csv
import json
import os
import socket
import warnings
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from lightning_parallel.causal_lm import IGNORE_INDEX
from lightning_parallel.hf import HFCausalLM
from lightning_parallel.text import (
    TextDataSettings,
    TextTokenizer,
    build_token_cache,
    load_tokenizer,
    open_token_cache,
    pack_rows,
    text_dataset,
)
from lightning_parallel.text import cache as cache_module

SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PAIRS = [
    ("What does len() return?", " The number of items."),
    ("Name a mutable sequence.", " A list."),
    ("How do you open a file?", " With open(path)."),
    ("What is None?", " The null object."),
    ("Which keyword defines a function?", " def"),
    ("What does a for loop iterate over?", " An iterable."),
]
CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a tuple?"},
        {"role": "assistant", "content": "An immutable sequence."},
        {"role": "user", "content": "And a set?"},
        {"role": "assistant", "content": "Unique items, unordered."},
    ],
    [{"role": "user", "content": "What is a dict?"}, {"role": "assistant", "content": "A mapping."}],
]


def _save_tokenizer(tok: Tokenizer, folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder


def _bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:30]], trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    """A BPE tokenizer (400 tokens, chat template) saved as transformers saves one."""
    return _save_tokenizer(_bpe(), tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def tok(bpe_folder) -> TextTokenizer:
    return load_tokenizer(None, bpe_folder)[0]


def _tiny_llama(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt_rows() -> list[dict]:
    return [{"prompt": p, "completion": c} for p, c in PAIRS]


def _sft(path: Path, seq_len: int = 48, **kw) -> TextDataSettings:
    return TextDataSettings(kind="sft", path=str(path), seq_len=seq_len, **kw)


def test_tokenizer_of_model_folder_explicit_folder_or_bytes(tmp_path, bpe_folder):
    model = tmp_path / "model"
    _tiny_llama(400).save_pretrained(model)
    found, reason = load_tokenizer(model)
    assert found is None and "no tokenizer in" in reason and "UTF-8 bytes" in reason and "data.tokenizer" in reason
    found, reason = load_tokenizer(model, bpe_folder)
    assert found.vocab_size == 400 and "data.tokenizer" in reason
    _save_tokenizer(_bpe(), model)
    found, reason = load_tokenizer(model)
    assert found.eos_id == SPECIALS.index("<|end|>") and found.pad_id == 0 and found.has_chat_template
    assert "model folder" in reason and "400 tokens" in reason
    assert load_tokenizer(None)[0] is None
    with pytest.raises(ValueError, match="data.tokenizer=.* is not a folder"):
        load_tokenizer(model, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="data.tokenizer=.*transformers cannot read a tokenizer"):
        load_tokenizer(model, tmp_path)


def test_litgpt_checkpoint_folder_uses_litgpts_tokenizer(tmp_path, bpe_folder, tok):
    from litgpt import Config
    from litgpt.utils import save_config

    folder = tmp_path / "lit"
    folder.mkdir()
    save_config(Config(block_size=64, vocab_size=400, padded_vocab_size=448, n_layer=1, n_head=2, n_embd=16), folder)
    assert load_tokenizer(folder)[0] is None  # a checkpoint without a tokenizer: bytes
    with pytest.raises(ValueError, match="data.tokenizer=.* holds no tokenizer.json or tokenizer.model"):
        load_tokenizer(None, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((bpe_folder / name).read_bytes())
    found, reason = load_tokenizer(folder)
    assert found.is_litgpt and "LitGPT" in reason and not found.has_chat_template
    text = topics["if"][:300]
    assert found.encode([text]) == tok.encode([text]) and found.eos_id == tok.eos_id
    assert found.decode(found.encode([text])[0]) == text
    path = _jsonl(tmp_path / "a.jsonl", _prompt_rows())
    lit, hf = (build_token_cache(_sft(path), t, tmp_path / "c") for t in (found, tok))
    assert lit.ids.tolist() == hf.ids.tolist() and lit.loss.tolist() == hf.loss.tolist() and lit.folder != hf.folder
    with pytest.raises(ValueError, match="has 400 tokens but the model's vocabulary holds 300"):
        load_tokenizer(folder, vocab_size=300)


def test_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, bpe_folder):
    model = tmp_path / "model"
    _tiny_llama(256).save_pretrained(model)
    with pytest.raises(ValueError, match=r"has 400 tokens but the model's vocabulary holds 256.*model\.vocab_size"):
        load_tokenizer(model, bpe_folder)
    assert load_tokenizer(model, bpe_folder, vocab_size=512)[0].vocab_size == 400  # the model's own override


def test_hf_text_documents_with_eos_between_packed_into_blocks(tmp_path, tok):
    docs = [topics[k] for k in sorted(topics)[40:48]]
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs] + [{"text": ""}])
    cache = build_token_cache(TextDataSettings(kind="hf_text", path=str(path), seq_len=64), tok, tmp_path / "c")
    expected = [i for d in docs for i in tok.encode([d])[0] + [tok.eos_id]]  # the empty document adds nothing
    assert cache.ids.dtype == np.uint16 and cache.ids.tolist() == expected
    data = text_dataset(cache, seq_len=64)
    assert len(data) == len(expected) // 64
    item = data[3]
    assert item["input_ids"].tolist() == expected[3 * 64 : 4 * 64] and torch.equal(item["labels"], item["input_ids"])
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(docs))  # a text file: one document per paragraph
    by_paragraph = build_token_cache(TextDataSettings(kind="hf_text", path=str(text), seq_len=64), tok, tmp_path / "c")
    assert by_paragraph.meta["samples"] > len(docs) and tok.eos_id in by_paragraph.ids


def _labeled_text(tok: TextTokenizer, item: dict) -> str:
    labels = item["labels"]
    return tok.decode(labels[labels != IGNORE_INDEX].tolist())


def test_sft_prompt_completion_from_jsonl_parquet_csv(tmp_path, tok):
    rows = _prompt_rows()
    paths = [_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "a.parquet", tmp_path / "a.csv"]
    pq.write_table(pa.Table.from_pylist(rows), paths[1])
    with open(paths[2], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        writer.writeheader(), writer.writerows(rows)
    caches = [build_token_cache(_sft(p), tok, tmp_path / "c") for p in paths]
    assert len({c.folder for c in caches}) == 3  # the files are in the key
    for cache in caches[1:]:
        assert cache.ids.tolist() == caches[0].ids.tolist() and cache.loss.tolist() == caches[0].loss.tolist()
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("prompt,completion\nWhat is 2+2?,4\nAnd 3+3?,6\n")  # datasets reads the answers as int64
    assert _labeled_text(tok, text_dataset(build_token_cache(_sft(numbers), tok, tmp_path / "c"), 48)[1]) == "6<|end|>"
    data = text_dataset(caches[0], seq_len=48)
    for item, (prompt, completion) in zip(data, PAIRS):
        n = len(tok.encode([prompt])[0])
        assert item["labels"][:n].eq(IGNORE_INDEX).all()  # no loss on the prompt
        assert _labeled_text(tok, item) == completion + "<|end|>"
        assert tok.decode(item["input_ids"][item["attention_mask"].bool()].tolist()) == prompt + completion + "<|end|>"
        assert item["labels"][~item["attention_mask"].bool()].eq(IGNORE_INDEX).all()  # nor on the padding
        assert item["input_ids"][~item["attention_mask"].bool()].eq(tok.pad_id).all()


def test_sft_messages_through_the_chat_template_train_on_assistant_turns_only(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    data = text_dataset(build_token_cache(_sft(path, seq_len=96), tok, tmp_path / "c"), seq_len=96)
    first = data[0]
    assert _labeled_text(tok, first) == "An immutable sequence.<|end|>Unique items, unordered.<|end|>"
    rendered = tok.decode(first["input_ids"][first["attention_mask"].bool()].tolist())
    assert rendered == tok.render_chat(CHATS[0], add_generation_prompt=False)
    assert _labeled_text(tok, data[1]) == "A mapping.<|end|>"


def test_packed_rows_restart_positions_and_give_the_padded_loss(tmp_path, tok):
    """Padded rows (attention mask) and packed rows (position ids restarting per sample, no attention mask) give
    a tiny Llama the same token-mean loss over the answers; plain positions across the packed samples do not."""
    cache = build_token_cache(_sft(_jsonl(tmp_path / "a.jsonl", _prompt_rows()), seq_len=64), tok, tmp_path / "c")
    lengths = np.diff(cache.offsets)
    padded, packed = text_dataset(cache, 64, packing=False), text_dataset(cache, 64, packing=True)
    assert pack_rows(lengths, 64).tolist() == packed.starts.tolist() and len(packed) < len(padded)
    row = packed[0]
    n0, n1 = lengths[0], lengths[1]
    assert row["position_ids"][: n0 + 2].tolist() == list(range(n0)) + [0, 1]
    assert row["document_ids"][n0 - 1 : n0 + 1].tolist() == [0, 1] and row["labels"][n0] == IGNORE_INDEX
    used = int(lengths[packed.starts[0] : packed.starts[1]].sum())
    assert row["position_ids"][used:].tolist() == list(range(64 - used)) and (row["labels"][used:] == -100).all()
    assert n0 + n1 <= 64 and (row["input_ids"][n0 : n0 + n1] == padded[1]["input_ids"][:n1]).all()

    torch.manual_seed(0)
    module = HFCausalLM(_tiny_llama(tok.vocab_size))
    module.materialize()  # built on meta from its config
    module.double()  # float64: equal up to rounding, not by luck
    collate = torch.utils.data.default_collate
    padded_batch, packed_batch = collate(list(padded)), collate(list(packed))
    assert module.unpack(padded_batch)[2]["attention_mask"] is padded_batch["attention_mask"]
    assert module.unpack(packed_batch)[2]["position_ids"] is packed_batch["position_ids"]
    with torch.no_grad():
        padded_loss = module._step_loss(padded_batch)
        # use_cache=False as HFCausalLM's forward: transformers finds the samples from the positions only then
        packed = module.model(**{k: packed_batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits
        plain = module.model(input_ids=packed_batch["input_ids"], use_cache=False).logits  # samples see each other
        alone = module.model(input_ids=padded_batch["input_ids"][1:2, :n1], use_cache=False).logits
    torch.testing.assert_close(packed[0, n0 : n0 + n1], alone[0], rtol=0, atol=1e-12)  # no attention across samples
    packed_loss = module.loss(packed, packed_batch["labels"])
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-6, atol=0)
    with torch.no_grad():  # HFCausalLM passes the batch's position ids on
        torch.testing.assert_close(module._step_loss(packed_batch), packed_loss, rtol=0, atol=0)
    assert (plain[0, n0 : n0 + n1] - alone[0]).abs().max() > 1e-2  # the test can fail: crossing attention shows
    assert abs(module.loss(plain, packed_batch["labels"]) - padded_loss) > 1e-5


class _Counting:
    """Counts TextTokenizer.encode calls (in this process: num_proc=1)."""

    def __init__(self, monkeypatch):
        self.calls, encode = 0, TextTokenizer.encode

        def counted(tokenizer, texts, special=True):
            self.calls += 1
            return encode(tokenizer, texts, special)

        monkeypatch.setattr(TextTokenizer, "encode", counted)


def test_cache_built_once_reused_and_rebuilt_when_the_files_change(tmp_path, tok, bpe_folder, monkeypatch):
    path = _jsonl(tmp_path / "a.jsonl", _prompt_rows())
    counter = _Counting(monkeypatch)
    first = build_token_cache(_sft(path), tok, tmp_path / "c")
    assert counter.calls > 0
    counter.calls = 0
    fresh = load_tokenizer(None, bpe_folder)[0]  # as a later run reads it again
    again = build_token_cache(_sft(path, num_proc=1, packing=True), fresh, tmp_path / "c")
    assert counter.calls == 0 and again.folder == first.folder  # packing is applied when read: same cache
    assert open_token_cache(first.folder).ids.tolist() == first.ids.tolist()
    assert first.meta["tokens_per_second"] > 0 and first.meta["tokens"] == len(first.ids)
    assert build_token_cache(_sft(path, seq_len=40), tok, tmp_path / "c").folder != first.folder
    assert counter.calls > 0
    counter.calls = 0
    _jsonl(path, _prompt_rows()[:3])  # rewritten: size and modification time change
    os.utime(path, ns=(1, 1))
    rebuilt = build_token_cache(_sft(path), tok, tmp_path / "c")
    assert counter.calls > 0 and rebuilt.folder != first.folder and rebuilt.meta["samples"] == 3
    assert len(list((tmp_path / "c").iterdir())) == 3  # two settings, then the new files: no temporary folder left


def test_cache_appears_whole_or_not_at_all(tmp_path, tok, monkeypatch):
    path = _jsonl(tmp_path / "a.jsonl", _prompt_rows())
    built = build_token_cache(_sft(path), tok, tmp_path / "first")
    before = (built.folder / "meta.json").read_text()
    files = cache_module.data_files(path)
    key = cache_module.cache_key(_sft(path), files, "json", tok)
    cache_module._build(built.folder, _sft(path), files, "json", tok, key)  # a second builder, finishing last
    assert (built.folder / "meta.json").read_text() == before and len(list((tmp_path / "first").iterdir())) == 1

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cache_module, "_write", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        build_token_cache(_sft(path), tok, tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []  # the half-built folder is gone, nothing is left to be read
    with pytest.raises(FileNotFoundError, match="holds no token cache"):
        open_token_cache(tmp_path / "c" / "sft-x")


def test_vocabulary_above_65535_gets_a_uint32_cache(tmp_path):
    words = [f"w{i}" for i in range(66_000)]
    vocab = {w: i for i, w in enumerate(["<unk>", "<|pad|>", "<|end|>"] + words)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok, _ = load_tokenizer(None, _save_tokenizer(word_level, tmp_path / "tok", chat_template=None))
    assert tok.vocab_size == 66_003
    docs = ["w0 w65999 w70 w65535", "w65534 w12 w65998"]
    path = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    cache = build_token_cache(TextDataSettings(kind="hf_text", path=str(path), seq_len=4), tok, tmp_path / "c")
    expected = [vocab[w] for d in docs for w in d.split() + ["<|end|>"]]
    assert cache.ids.dtype == np.uint32 and cache.ids.tolist() == expected and max(expected) > 65_535


def test_parallel_tokenization_gives_the_serial_cache(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", [{"messages": m} for m in CHATS * 3] + [{"messages": CHATS[1]}])
    serial = build_token_cache(_sft(path, seq_len=96), tok, tmp_path / "serial")
    parallel = build_token_cache(_sft(path, seq_len=96, num_proc=2), tok, tmp_path / "parallel")
    assert parallel.ids.tolist() == serial.ids.tolist() and parallel.loss.tolist() == serial.loss.tolist()
    assert parallel.offsets.tolist() == serial.offsets.tolist()


def test_no_network_is_attempted(tmp_path, tok, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    path = _jsonl(tmp_path / "a.jsonl", _prompt_rows())
    assert build_token_cache(_sft(path), tok, tmp_path / "c").meta["samples"] == len(PAIRS)


def test_missing_columns_are_listed(tmp_path, tok):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"'prompt'\+'completion'.*hold \['question', 'answer'\].*prompt_column"):
        build_token_cache(_sft(path), tok, tmp_path / "c")
    with pytest.raises(ValueError, match=r"data=hf_text needs the column\(s\) 'text'.*\['question', 'answer'\]"):
        build_token_cache(TextDataSettings(kind="hf_text", path=str(path), seq_len=8), tok, tmp_path / "c")
    ok = build_token_cache(_sft(path, prompt_column="question", completion_column="answer"), tok, tmp_path / "c")
    assert ok.meta["columns"] == ["question", "answer"]


def test_chat_data_without_a_chat_template_is_refused(tmp_path, tok):
    plain, _ = load_tokenizer(None, _save_tokenizer(_bpe(), tmp_path / "plain", chat_template=None))
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    refused = "has no chat template: give one .*data.chat_template=FILE.*use a tokenizer with one "
    refused += ".*'prompt' / 'completion'"
    with pytest.raises(ValueError, match=refused):
        build_token_cache(_sft(path), plain, tmp_path / "c")
    no_answer = _jsonl(tmp_path / "q.jsonl", [{"messages": CHATS[0][:2]}])
    with pytest.raises(ValueError, match="has no assistant message"):
        build_token_cache(_sft(no_answer), tok, tmp_path / "c")


def test_long_samples_are_cut_counted_and_warned_about_once(tmp_path, tok):
    rows = _prompt_rows() + [
        {"prompt": "Explain. " * 20, "completion": " ok"},
        {"prompt": "Q", "completion": " a" * 40},
    ]
    path = _jsonl(tmp_path / "a.jsonl", rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = build_token_cache(_sft(path, seq_len=40), tok, tmp_path / "c")
    ours = [w for w in caught if "longer than seq_len" in str(w.message)]
    assert len(ours) == 1 and "2 of 8 samples are longer than seq_len=40" in str(ours[0].message)
    assert "1 samples hold no answer token" in str(ours[0].message)  # the long prompt left no room for its answer
    assert cache.meta["truncated"] == 2 and np.diff(cache.offsets).max() == 40
    assert all(len(item["input_ids"]) == 40 for item in text_dataset(cache, 40, packing=True))


def test_empty_data_is_refused(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    header_only = tmp_path / "h.csv"
    header_only.write_text("prompt,completion\n")
    for path in (empty, header_only):
        with pytest.raises(ValueError, match="holds no rows: point data.path at files with data"):
            build_token_cache(_sft(path), tok, tmp_path / "c")
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(ValueError, match="hold no text to train on"):
        build_token_cache(TextDataSettings(kind="hf_text", path=str(blank), seq_len=8), tok, tmp_path / "c")
    few = _jsonl(tmp_path / "few.jsonl", [{"text": "a b"}])
    with pytest.raises(ValueError, match="fewer than one block of seq_len=512"):
        text_dataset(build_token_cache(TextDataSettings("hf_text", str(few), 512), tok, tmp_path / "c"), 512)
    with pytest.raises(FileNotFoundError, match="names no local file"):
        build_token_cache(_sft(tmp_path / "missing.jsonl"), tok, tmp_path / "c")
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", _prompt_rows()), (tmp_path / "mixed" / "b.csv").write_text("prompt\n")
    with pytest.raises(ValueError, match=r"mixes formats \['csv', 'json'\]"):
        build_token_cache(_sft(tmp_path / "mixed"), tok, tmp_path / "c")
    with pytest.raises(ValueError, match="data.kind='chat' is unknown"):
        TextDataSettings(kind="chat", path=str(few), seq_len=8)
