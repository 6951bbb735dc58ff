"""Tokenized text in the recipes: ``data=hf_text`` and ``data=sft`` (and ``data=text`` with a model folder that has a
tokenizer). The parent process picks the tokenizer, builds the token cache (:mod:`lightning_parallel.text`) and
checks the splits before any worker starts, writing the cache folders into ``data.cache`` / ``data.val_cache``;
every rank then memory-maps them (:class:`TokenizedData`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.utils.data import Dataset, Subset

from lightning_parallel.recipes.model_kinds import kind_of
from lightning_parallel.recipes.text_data import DEFAULT_CORPUS, write_default_corpus
from lightning_parallel.text import (
    TextDataSettings,
    TextTokenizer,
    build_token_cache,
    load_tokenizer,
    open_token_cache,
    text_dataset,
)

log = logging.getLogger(__name__)
TOKENIZED_KINDS = ("hf_text", "sft")


def data_cache_dir(d: DictConfig) -> Path:
    """Where the token caches lie: ``data.cache_dir``, else data/token_cache under the working directory."""
    return Path(d.get("cache_dir") or Path.cwd() / "data" / "token_cache").expanduser()


def is_library_model(m: DictConfig) -> bool:
    """A model whose family trains on tokenized data (``model=hf*``, ``model=litgpt*``: ``ModelKind.tokenized``)."""
    return kind_of(m).tokenized


def recipe_tokenizer(cfg: DictConfig) -> tuple[TextTokenizer | None, str]:
    """The tokenizer the run trains with, and why (see :func:`~lightning_parallel.text.load_tokenizer`):
    ``data.tokenizer``, else the model folder's own (LitGPT's ``Tokenizer`` and prompt style for a LitGPT
    checkpoint folder); None (bytes) for a model with neither; with ``data.chat_template=FILE`` that template renders
    the conversations (and the prompts answered). Refused when it does not fit the model's vocabulary (a LitGPT
    model's ``padded_vocab_size``)."""
    m, kind = cfg.model, kind_of(cfg.model)
    folder, vocab = None, None
    if kind.tokenized:
        folder, vocab = kind.tokenizer_folder(m), kind.vocab_size(m)
    tokenizer, reason = load_tokenizer(folder, cfg.data.get("tokenizer"), vocab_size=vocab)
    template = cfg.data.get("chat_template")
    if template is None:
        return tokenizer, reason
    return with_chat_template(tokenizer, template), f"{reason}, chat template {template!r}"


def with_chat_template(tokenizer: TextTokenizer | None, path: str) -> TextTokenizer:
    """``tokenizer`` rendering conversations with the Jinja template in the file ``path`` (``data.chat_template``).

    Raises:
        ValueError: no tokenizer, a LitGPT tokenizer (its prompt style writes the prompts), or no such file.
    """
    if tokenizer is None or tokenizer.is_litgpt:
        what = "no tokenizer (the data are bytes)" if tokenizer is None else "LitGPT's tokenizer (its prompt style)"
        raise ValueError(
            f"data.chat_template={path!r} needs a transformers tokenizer and the run has {what}: give a model folder "
            "with one (or data.tokenizer=FOLDER), or unset data.chat_template."
        )
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"data.chat_template={path!r} is not a file: give a Jinja template file (e.g. chat_template.jinja)."
        )
    tokenizer.backend.chat_template = file.read_text()
    return tokenizer


def _settings(d: DictConfig, path: str, seq_len: int) -> TextDataSettings:
    keys = ("format", "packing", "text_column", "messages_column", "prompt_column", "completion_column", "sample_by")
    return TextDataSettings(kind=d.kind, path=path, seq_len=seq_len, num_proc=d.num_proc, **{k: d[k] for k in keys})


def _build(cfg: DictConfig, tokenizer: TextTokenizer, path: str, key: str) -> str:
    """The cache of ``path``; the text package's errors name ``data.<key>``."""
    settings = _settings(cfg.data, path, cfg.model.seq_len)
    try:
        return str(build_token_cache(settings, tokenizer, data_cache_dir(cfg.data)).folder)
    except (ValueError, FileNotFoundError) as err:
        message = str(err).replace("data.path=", f"data.{key}=")
        raise type(err)(message if f"data.{key}" in message else f"data.{key}={path!r}: {message}") from None


def prepare_tokenized_data(cfg: DictConfig) -> None:
    """In the parent, before any worker starts: the tokenizer chosen (logged), the token caches built and their
    folders set in ``data.cache`` / ``data.val_cache``; for ``data=text`` with a tokenizer, the text file's
    documents tokenized (``hf_text`` blocks), without one the byte-level data stay (and the log says so).

    Raises:
        ValueError: no tokenizer for ``data=hf_text/sft``, bad files or columns, splits too small for a batch.
    """
    d, kind = cfg.data, kind_of(cfg.model)
    if d.kind in TOKENIZED_KINDS and not kind.tokenized:
        raise ValueError(
            f"data={d.kind} trains Hugging Face and LitGPT models (model=hf*, e.g. model=hf model.path=FOLDER, or "
            "model=litgpt*): the other models read byte-level data=text or data=tokens."
        )
    if d.kind == "sft" and d.packing and kind.no_packing:
        raise ValueError(f"data.packing=true with {kind.no_packing}: set data.packing=false (each sample padded).")
    tokenizer, reason = recipe_tokenizer(cfg)
    if d.kind not in TOKENIZED_KINDS:  # data=text: a model folder's tokenizer, else bytes
        log.info(f"Tokenizer: {reason}.")
        if tokenizer is None or d.kind != "text":
            return
        path = d.path or str(write_default_corpus(Path.cwd() / "data" / DEFAULT_CORPUS))
        settings = TextDataSettings(kind="hf_text", path=path, seq_len=cfg.model.seq_len, sample_by="document")
        d.cache = str(build_token_cache(settings, tokenizer, data_cache_dir(d)).folder)
        _check_splits(cfg)
        return
    if tokenizer is None:
        raise ValueError(
            f"data={d.kind} needs a tokenizer and there is none: {reason}. Use model=hf model.path=FOLDER (or a "
            "LitGPT checkpoint folder, model=litgpt_chat_tiny model.path=FOLDER) with a tokenizer in it, or "
            "data.tokenizer=FOLDER."
        )
    log.info(f"Tokenizer: {reason}.")
    if d.path is None:
        raise ValueError(f"data={d.kind} needs data.path=FILE (or a folder or glob of json/jsonl/parquet/csv/txt).")
    if not 0 < d.val_fraction < 1 and d.val_path is None:
        raise ValueError(f"data.val_fraction={d.val_fraction} must lie between 0 and 1: e.g. data.val_fraction=0.1.")
    d.cache = _build(cfg, tokenizer, d.path, "path")
    d.val_cache = _build(cfg, tokenizer, d.val_path, "val_path") if d.val_path is not None else None
    _check_splits(cfg)


def splits(cfg: DictConfig) -> tuple[Dataset, Dataset]:
    """The training and validation datasets of the built caches: ``data.val_cache``'s, else the last
    ``data.val_fraction`` of the samples (rows once packed, blocks for ``hf_text``), at least one validation batch
    of every dp rank (``data.global_batch_size / trainer.accumulate_grad_batches`` rows)."""
    d, seq = cfg.data, cfg.model.seq_len
    # LitGPT's GPT takes no attention mask: its causal attention keeps the samples from their right padding
    options = {"packing": bool(d.get("packing", False)), "attention_mask": kind_of(cfg.model).attention_mask}
    train = text_dataset(open_token_cache(d.cache), seq, **options)
    if d.get("val_cache"):
        return train, text_dataset(open_token_cache(d.val_cache), seq, **options)
    n_val = max(int(len(train) * d.val_fraction), _val_rows(cfg))
    return Subset(train, range(len(train) - n_val)), Subset(train, range(len(train) - n_val, len(train)))


def _val_rows(cfg: DictConfig) -> int:
    """Rows one validation step reads over all dp ranks (the loaders keep whole batches only)."""
    return max(1, cfg.data.global_batch_size // cfg.trainer.accumulate_grad_batches)


def _check_splits(cfg: DictConfig) -> None:
    train, val = splits(cfg)
    d, batch = cfg.data, cfg.data.global_batch_size
    if len(train) < batch or len(val) < _val_rows(cfg):
        where = f"data.path={d.path!r}" + (f" and data.val_path={d.val_path!r}" if d.get("val_path") else "")
        raise ValueError(
            f"{where} give {len(train)} training and {len(val)} validation rows of model.seq_len={cfg.model.seq_len}, "
            f"fewer than one data.global_batch_size={batch} (validation: {_val_rows(cfg)} rows): give more data, or "
            "lower data.global_batch_size."
        )
    if not d.get("val_path") and len(val) > int((len(train) + len(val)) * d.val_fraction):
        log.warning(
            f"data.val_fraction={d.val_fraction} of {len(train) + len(val)} rows is less than one validation batch: "
            f"validating on the last {len(val)} rows."
        )


def tokenizer_of(cfg: DictConfig) -> TextTokenizer | None:
    """In a worker: the tokenizer the parent picked (None for byte-level data)."""
    return recipe_tokenizer(cfg)[0] if cfg.data.get("cache") else None


def decode_new(tokenizer: TextTokenizer, ids: Any, prompt_len: int) -> str:
    """The text of the ids after the prompt, up to the end-of-text token."""
    new = [int(i) for i in ids[prompt_len:]]
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)
