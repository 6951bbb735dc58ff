"""What the text data are (:class:`TextDataSettings`), and rows made token ids: ``hf_text`` documents (the
tokenizer's ids, EOS after each), ``sft`` samples (a ``messages`` conversation rendered by the chat template, or
``prompt`` + ``completion``; with LitGPT's tokenizer the prompt in its prompt style, and single-turn conversations
only) with a loss mask that is 1 on the answer tokens only. The ``tokenize_*`` functions run under
``datasets.map(batched=True)``, in worker processes with ``num_proc > 1``: plain functions of a batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lightning_parallel.text.tokenizer import TextTokenizer

KINDS = ("hf_text", "sft")


@dataclass(frozen=True)
class TextDataSettings:
    """The settings of the text data (the recipe's ``data.*``).

    Args:
        kind: ``hf_text`` (documents packed into ``seq_len`` blocks) or ``sft`` (instruction samples).
        path: a local file, a folder of files or a glob (json, jsonl, parquet, csv, txt).
        seq_len: tokens per sample; longer ``sft`` samples are cut to it (counted, warned once).
        format: the files' format (json, parquet, csv, text); None: from their suffix.
        packing: ``sft`` only: True packs several samples into each ``seq_len`` row (position ids restarting per
            sample, document ids: no attention across samples); False pads each sample to ``seq_len`` (attention
            mask).
        text_column: ``hf_text``: the column holding the documents.
        messages_column: ``sft``: the column of conversations (lists of ``{"role", "content"}``).
        prompt_column: ``sft``: the prompt column (used when there is no messages column).
        completion_column: ``sft``: the answer column beside the prompt.
        sample_by: text files: one document per ``line``, ``paragraph`` (blank-line separated) or ``document``.
        num_proc: processes tokenizing in parallel (``datasets.map(num_proc=...)``).
    """

    kind: str
    path: str
    seq_len: int
    format: str | None = None
    packing: bool = False
    text_column: str = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    sample_by: str = "paragraph"
    num_proc: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"data.kind={self.kind!r} is unknown: use one of {list(KINDS)}.")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} is too short: give at least 2 tokens per sample.")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc}: give 1 or more processes.")
        if self.kind == "hf_text" and self.packing:
            warnings.warn("data.packing=true is ignored by data=hf_text: its documents fill every block.", stacklevel=3)

    def column_options(self) -> list[list[str]]:
        """The column sets this kind reads, the preferred first."""
        if self.kind == "hf_text":
            return [[self.text_column]]
        return [[self.messages_column], [self.prompt_column, self.completion_column]]


def _text(value: Any) -> str:
    """A cell as text: "" for an empty one; a csv column of numbers is read as numbers."""
    return "" if value is None else str(value)


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def tokenize_documents(batch: dict[str, list], tokenizer: TextTokenizer, column: str) -> dict[str, list]:
    """``hf_text``: each document's ids with EOS after it (empty documents dropped)."""
    texts = [_text(t) for t in batch[column] if _text(t)]  # None (a csv's empty cell) and "" hold nothing
    return {"ids": [_with_eos(ids, tokenizer.eos_id) for ids in tokenizer.encode(texts)]}


def _add(out: dict[str, list], ids: list[int], loss: list[int], seq_len: int) -> None:
    """One sample into ``out``, cut to ``seq_len`` tokens (``truncated`` says whether it was)."""
    out["ids"].append(ids[:seq_len])
    out["loss"].append(loss[:seq_len])
    out["truncated"].append(len(ids) > seq_len)


def tokenize_prompts(
    batch: dict[str, list], tokenizer: TextTokenizer, prompt: str, completion: str, seq_len: int
) -> dict[str, list]:
    """``sft`` from prompt / completion columns: prompt ids (written in LitGPT's prompt style where the tokenizer has
    one; the tokenizer's special tokens, e.g. BOS), answer ids and EOS; loss mask 1 on the answer and the EOS (the
    model learns to stop)."""
    prompts = tokenizer.encode([tokenizer.render_prompt(_text(p)) for p in batch[prompt]])
    answers = tokenizer.encode([_text(c) for c in batch[completion]], special=False)
    out: dict[str, list] = {"ids": [], "loss": [], "truncated": []}
    for p, a in zip(prompts, answers):
        a = _with_eos(a, tokenizer.eos_id)
        _add(out, p + a, [0] * len(p) + [1] * len(a), seq_len)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def chat_sample(tokenizer: TextTokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A conversation's ids as its chat template renders it, with loss 1 on every assistant turn's tokens.

    Each assistant turn's span is found by rendering the conversation up to it (with the generation prompt) and
    through it: its tokens are those after the first rendering's shared prefix with the whole, up to the second's.
    A template that writes earlier turns differently once later ones follow (one that drops past reasoning, say)
    trains from the first token where the renderings differ.
    """
    full = tokenizer.encode([tokenizer.render_chat(messages, add_generation_prompt=False)], special=False)[0]
    loss = [0] * len(full)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True) if i else ""
        through = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        start_ids, end_ids = tokenizer.encode([before, through], special=False)
        start, end = _common_prefix(start_ids, full), _common_prefix(end_ids, full)
        loss[start:end] = [1] * (end - start)
    return full, loss


def tokenize_chats(batch: dict[str, list], tokenizer: TextTokenizer, column: str, seq_len: int) -> dict[str, list]:
    """``sft`` from a messages column (see :func:`chat_sample`), each sample cut to ``seq_len``."""
    out: dict[str, list] = {"ids": [], "loss": [], "truncated": []}
    for messages in batch[column]:
        if not messages or not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(
                f"data=sft: a conversation in data.messages_column={column!r} has no assistant message, so nothing "
                f"to learn ({messages!r}): give each conversation an answer with role 'assistant'."
            )
        _add(out, *chat_sample(tokenizer, messages), seq_len)
    return out


def single_turn(messages: list[dict[str, Any]], column: str) -> tuple[str, str]:
    """(prompt, answer) of a conversation of one user turn and the assistant's answer: what LitGPT's prompt styles
    write (``PromptStyle.apply`` takes one prompt).

    Raises:
        ValueError: any other conversation (a system turn, several turns), naming the fix.
    """
    if [m.get("role") for m in messages or []] != ["user", "assistant"]:
        roles = [m.get("role") for m in messages or []]
        raise ValueError(
            f"data=sft with LitGPT's tokenizer: a conversation in data.messages_column={column!r} has the turns "
            f"{roles}, and LitGPT's prompt styles write one user prompt and its answer (['user', 'assistant']): give "
            "such conversations, or the data as prompt / completion columns."
        )
    return messages[0]["content"], messages[1]["content"]


def tokenize_single_turns(
    batch: dict[str, list], tokenizer: TextTokenizer, column: str, seq_len: int
) -> dict[str, list]:
    """``sft`` from a messages column with LitGPT's tokenizer: each conversation (see :func:`single_turn`) as a
    prompt / completion row."""
    pairs = [single_turn(messages, column) for messages in batch[column]]
    rows = {"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]}
    return tokenize_prompts(rows, tokenizer, "prompt", "completion", seq_len)


def tokenize_function(settings: TextDataSettings, columns: list[str], tokenizer: TextTokenizer) -> tuple[Any, dict]:
    """The ``datasets.map`` function for these settings and columns, and its keyword arguments.

    Raises:
        ValueError: a messages column and a tokenizer without a chat template.
    """
    if settings.kind == "hf_text":
        return tokenize_documents, {"tokenizer": tokenizer, "column": columns[0]}
    if columns == [settings.messages_column]:
        if tokenizer.prompt_style is not None:  # LitGPT's: one prompt and its answer per conversation
            return tokenize_single_turns, {"tokenizer": tokenizer, "column": columns[0], "seq_len": settings.seq_len}
        if not tokenizer.has_chat_template:
            raise ValueError(
                f"data=sft: the files hold conversations ({settings.messages_column!r}) but the tokenizer "
                f"{tokenizer.source!r} has no chat template: give one (data.chat_template=FILE, a Jinja file), use "
                f"a tokenizer with one (data.tokenizer=FOLDER), or give the data as {settings.prompt_column!r} / "
                f"{settings.completion_column!r} columns."
            )
        return tokenize_chats, {"tokenizer": tokenizer, "column": columns[0], "seq_len": settings.seq_len}
    prompt, completion = columns
    kwargs = {"tokenizer": tokenizer, "prompt": prompt, "completion": completion, "seq_len": settings.seq_len}
    return tokenize_prompts, kwargs
