"""The fine-tuning recipe's default assets, made locally on first use (nothing is downloaded): a small instruction set
of templated prompt / answer pairs (a ``messages`` jsonl), a byte-level BPE tokenizer trained on it with
``tokenizers`` and saved with a chat template, and a tiny Llama config beside it (fresh weights at training time);
and a tiny LitGPT checkpoint folder written with litgpt's own pieces (``model_config.yaml`` from its ``Config``,
``lit_model.pth``, the same BPE as ``tokenizer.json``, LitGPT's ``phi-2`` prompt style in ``prompt_style.yaml``).
Everything is deterministic: the same files on every machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

MODEL_DIR, LITGPT_DIR, DATA_FILE = "tiny_llama", "tiny_litgpt", "instructions.jsonl"
LITGPT_PROMPT_STYLE = "phi-2"  # "Instruct: {prompt}\nOutput:": a few tokens of the tiny BPE
SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "Greece": "Athens",
    "Canada": "Ottawa", "Chile": "Santiago", "Cuba": "Havana", "Ireland": "Dublin", "Poland": "Warsaw",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "open": "closed", "light": "dark",
    "early": "late", "full": "empty", "hard": "soft", "old": "new", "wet": "dry", "high": "low",
}  # fmt: skip
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def instruction_pairs() -> list[tuple[str, str]]:
    """About 220 (prompt, answer) pairs from a few templates, in a fixed order."""
    pairs = [(f"What is the capital of {c}?", f"The capital of {c} is {a}.") for c, a in CAPITALS.items()]
    pairs += [(f"What is the opposite of {w}?", f"The opposite of {w} is {o}.") for w, o in OPPOSITES.items()]
    pairs += [(f"What is the opposite of {o}?", f"The opposite of {o} is {w}.") for w, o in OPPOSITES.items()]
    pairs += [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(10) for b in range(10)]
    pairs += [(f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}.") for a in range(10) for b in range(a + 1)]
    pairs += [(f"Spell the number {n}.", " ".join(NUMBERS[n].upper())) for n in range(10)]
    pairs += [(f"Write {n} in words.", f"{n} is {NUMBERS[n]}.") for n in range(10)]
    pairs += [(f"What comes after {NUMBERS[n]}?", f"After {NUMBERS[n]} comes {NUMBERS[n + 1]}.") for n in range(9)]
    random.Random(0).shuffle(pairs)  # the validation split (the last samples) draws from every template
    return pairs


def write_texts(folder: str | Path, files: int = 4) -> Path:
    """``files`` small ``.txt`` files of prose (the instruction pairs run together) in ``folder``: local pretraining
    text (:class:`lightning_parallel.litgpt.text_data.TextBlocks`). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pairs = instruction_pairs()
    for index in range(files):
        (folder / f"part{index}.txt").write_text(" ".join(f"{p} {a}" for p, a in pairs[index::files]))
    return folder


def _train_tokenizer(texts: list[str], folder: Path, vocab_size: int) -> int:
    """A byte-level BPE with the chat template, saved as transformers saves one; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return len(fast)


def _save_llama_config(folder: Path, vocab_size: int) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=SPECIALS.index("<|pad|>"),
        eos_token_id=SPECIALS.index("<|end|>"), bos_token_id=None, tie_word_embeddings=False,
        initializer_range=0.1,  # a frozen fresh head at the default 0.02 gives logits too flat for LoRA to sharpen
    )  # fmt: skip
    config.save_pretrained(folder)


def _save_litgpt_folder(folder: Path, tokenizer_folder: Path, vocab_size: int) -> None:
    """A tiny Llama-style LitGPT (2 layers, 64 wide, grouped-query attention) as ``litgpt`` writes a checkpoint
    folder: its Config, seeded weights, the BPE's tokenizer.json with a tokenizer_config.json naming the special
    tokens (what ``litgpt.Tokenizer`` reads), and the prompt style."""
    import torch
    from litgpt import GPT, Config
    from litgpt.prompts import save_prompt_style
    from litgpt.utils import save_config

    config = Config(
        name="tiny-litgpt-chat", block_size=128, vocab_size=vocab_size, padded_vocab_size=vocab_size, n_layer=2,
        n_head=4, n_query_groups=2, n_embd=64, intermediate_size=128, rotary_percentage=1.0, parallel_residual=False,
        bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
    )  # fmt: skip
    folder.mkdir()
    save_config(config, folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(config)
        for weight in (p for p in model.parameters() if p.dim() == 2):  # as the tiny Llama's initializer_range
            torch.nn.init.normal_(weight, std=0.1)
        torch.save(model.state_dict(), folder / "lit_model.pth")
    shutil.copy(tokenizer_folder / "tokenizer.json", folder / "tokenizer.json")
    specials = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "pad_token": "<|pad|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**specials, "add_bos_token": False}, indent=2))
    save_prompt_style(LITGPT_PROMPT_STYLE, folder)


def make_default_assets(folder: str | Path, vocab_size: int = 512) -> tuple[Path, Path]:
    """The tiny model folder (tokenizer and config.json), the tiny LitGPT checkpoint folder (``tiny_litgpt``) and
    the instruction set under ``folder``: made once (in a temporary folder renamed into place, so a reader never
    sees half of them), then reused.

    Args:
        folder: where they lie (``assets`` in conf/finetune.yaml).
        vocab_size: the BPE's vocabulary (special tokens and the 256 bytes included).

    Returns:
        ``(model_folder, data_file)``.
    """
    folder = Path(folder).expanduser()
    model, data = folder / MODEL_DIR, folder / DATA_FILE
    if model.is_dir() and data.is_file() and (folder / LITGPT_DIR).is_dir():
        return model, data
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / MODEL_DIR).mkdir(parents=True)
    pairs = instruction_pairs()
    rows = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} for p, a in pairs]
    (tmp / DATA_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    size = _train_tokenizer([f"{p} {a}" for p, a in pairs], tmp / MODEL_DIR, vocab_size)
    _save_llama_config(tmp / MODEL_DIR, size)
    _save_litgpt_folder(tmp / LITGPT_DIR, tmp / MODEL_DIR, size)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(folder) if not folder.exists() else _merge(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model, data


def _merge(tmp: Path, folder: Path) -> None:
    """``folder`` exists (part of the assets, or other files): the missing pieces moved in."""
    for name in (MODEL_DIR, LITGPT_DIR, DATA_FILE):
        if not (folder / name).exists():
            (tmp / name).rename(folder / name)
