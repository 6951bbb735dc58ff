"""The tokenizer a model is trained with: the model folder's own (transformers' ``AutoTokenizer``, or LitGPT's
``Tokenizer`` for a LitGPT checkpoint folder), or an explicit tokenizer folder; None (UTF-8 bytes) for a folder
without one. One small interface over both (:class:`TextTokenizer`): what the data layer needs, nothing more.
Nothing is downloaded: every load is ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# the files a transformers tokenizer is read from (any one is enough for AutoTokenizer to try)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt")
LITGPT_CONFIG = "model_config.yaml"  # marks a LitGPT checkpoint folder
LITGPT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # what litgpt.Tokenizer reads, in its order


class TextTokenizer:
    """Text to token ids and back, the same for a transformers tokenizer and LitGPT's.

    Args:
        backend: the library's tokenizer (a transformers ``PreTrainedTokenizerBase`` or a ``litgpt.Tokenizer``).
        source: where it was read from (a folder, or a name), for messages.
        prompt_style: LitGPT's ``litgpt.prompts.PromptStyle`` of the checkpoint folder (its prompt_style.yaml, else
            the one ``PromptStyle.from_config`` picks by the config's name): how a prompt is written before its answer.
    """

    def __init__(self, backend: Any, source: str, prompt_style: Any = None) -> None:
        self.backend, self.source, self.prompt_style = backend, source, prompt_style
        self.is_litgpt = type(backend).__module__.startswith("litgpt")
        self._fingerprint: str | None = None

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce is below this (added tokens included)."""
        if self.is_litgpt:
            processor = self.backend.processor
            if self.backend.backend == "huggingface":
                return processor.get_vocab_size(with_added_tokens=True)
            return self.backend.vocab_size
        return len(self.backend)

    @property
    def eos_id(self) -> int | None:
        """The end-of-text id (after each document, each answer), None when the tokenizer has none."""
        return self.backend.eos_id if self.is_litgpt else self.backend.eos_token_id

    @property
    def pad_id(self) -> int:
        """The id written in padding (never trained on: its labels are -100): the pad token, else EOS, else 0."""
        pad = None if self.is_litgpt else self.backend.pad_token_id
        return next((i for i in (pad, self.eos_id) if i is not None), 0)

    @property
    def has_chat_template(self) -> bool:
        """Whether ``messages`` can be rendered (transformers tokenizers with a chat template only)."""
        return not self.is_litgpt and getattr(self.backend, "chat_template", None) is not None

    def render_prompt(self, prompt: str) -> str:
        """A prompt as the model sees it before its answer: LitGPT's prompt style applied, else the text itself."""
        return self.prompt_style.apply(prompt) if self.prompt_style is not None else prompt

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """The ids of each text; ``special``: with the tokenizer's own special tokens (e.g. Llama's BOS)."""
        if not texts:
            return []
        if self.is_litgpt:
            return [self.backend.encode(t, bos=None if special else False).tolist() for t in texts]
        return self.backend(texts, add_special_tokens=special, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens written out)."""
        if self.is_litgpt:
            import torch

            return self.backend.decode(torch.tensor(ids))
        return self.backend.decode(ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """``messages`` as the chat template writes them (special tokens included: encode with special=False)."""
        return self.backend.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def fingerprint(self) -> str:
        """A hash of everything that decides the ids: the vocabulary and rules, the chat template, the size."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"{type(self.backend).__name__}:{self.vocab_size}:{self.eos_id}".encode())
            if self.is_litgpt:
                h.update(f"{self.backend.use_bos}:{self.backend.bos_id}".encode())
                processor, hf = self.backend.processor, self.backend.backend == "huggingface"
                h.update(processor.to_str().encode() if hf else processor.serialized_model_proto())
            elif getattr(self.backend, "backend_tokenizer", None) is not None:  # a fast tokenizer: its whole state
                h.update(self.backend.backend_tokenizer.to_str().encode())
            else:  # a slow (Python) tokenizer: the files it was read from
                h.update(_files_digest(Path(self.backend.name_or_path)).encode())
            h.update(str(getattr(self.backend, "chat_template", None)).encode())
            if self.prompt_style is not None:  # LitGPT's: it writes every prompt
                style = type(self.prompt_style)
                h.update(f"{style.__module__}.{style.__qualname__}".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return f"TextTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _files_digest(folder: Path) -> str:
    h = hashlib.sha256(str(folder).encode())
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        if f.is_file() and f.suffix in (".json", ".model", ".txt", ".jinja"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _hf_tokenizer(folder: Path, setting: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    try:
        backend = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{setting}={str(folder)!r}: transformers cannot read a tokenizer there ({err}).") from None
    return TextTokenizer(backend, str(folder))


def _litgpt_tokenizer(folder: Path, setting: str) -> TextTokenizer:
    """LitGPT's ``Tokenizer`` and prompt style of a checkpoint folder, as ``litgpt generate`` picks them."""
    from litgpt import Config, Tokenizer
    from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style

    if not any((folder / f).is_file() for f in LITGPT_TOKENIZER_FILES):
        raise ValueError(
            f"{setting}={str(folder)!r} holds no {' or '.join(LITGPT_TOKENIZER_FILES)}: give a folder with one."
        )
    if has_prompt_style(folder):
        style = load_prompt_style(folder)
    else:
        style = PromptStyle.from_config(Config.from_file(folder / LITGPT_CONFIG))
    return TextTokenizer(Tokenizer(folder), str(folder), prompt_style=style)


def model_vocab_size(folder: Path) -> int | None:
    """The vocabulary of the model in a folder: ``vocab_size`` of config.json, LitGPT's ``padded_vocab_size`` of
    model_config.yaml; None when the folder says neither."""
    if (folder / LITGPT_CONFIG).is_file():
        from litgpt import Config

        return Config.from_file(folder / LITGPT_CONFIG).padded_vocab_size
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()).get("vocab_size")
    return None


def load_tokenizer(
    model_folder: str | Path | None, tokenizer: str | Path | None = None, *, vocab_size: int | None = None
) -> tuple[TextTokenizer | None, str]:
    """The tokenizer to train a model with, and the reason for the choice (for the log).

    Args:
        model_folder: the model's local folder (a ``save_pretrained`` folder or a LitGPT checkpoint folder), or
            None for a model built from a config.
        tokenizer: a folder holding a tokenizer (``data.tokenizer``), used instead of the model folder's.
        vocab_size: the model's vocabulary, when it is not the model folder's (e.g. ``model.vocab_size``).

    Returns:
        ``(tokenizer, reason)``; ``tokenizer`` is None when there is none to use: the data are then UTF-8 bytes.

    Raises:
        ValueError: ``tokenizer`` is not a readable tokenizer folder, or the tokenizer's vocabulary does not fit
            the model's (both sizes named).
    """
    folder = Path(model_folder).expanduser() if model_folder is not None else None
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.is_dir():
            raise ValueError(f"data.tokenizer={str(tokenizer)!r} is not a folder: give a local tokenizer folder.")
        litgpt = (path / LITGPT_CONFIG).is_file()
        found = _litgpt_tokenizer(path, "data.tokenizer") if litgpt else _hf_tokenizer(path, "data.tokenizer")
        reason = f"the tokenizer of data.tokenizer={str(path)!r}"
    elif folder is None:
        return None, "no model folder and no data.tokenizer: the data are UTF-8 bytes (vocabulary 256)"
    elif (folder / LITGPT_CONFIG).is_file():
        if not any((folder / f).is_file() for f in LITGPT_TOKENIZER_FILES):
            return None, _bytes_reason(folder, LITGPT_TOKENIZER_FILES)
        found = _litgpt_tokenizer(folder, "model.path")
        reason = f"LitGPT's tokenizer of the checkpoint folder {str(folder)!r}"
    elif any((folder / f).is_file() for f in HF_TOKENIZER_FILES):
        found, reason = _hf_tokenizer(folder, "model.path"), f"the tokenizer of the model folder {str(folder)!r}"
    else:
        return None, _bytes_reason(folder, HF_TOKENIZER_FILES)
    model_vocab = vocab_size if vocab_size is not None else (model_vocab_size(folder) if folder else None)
    if model_vocab is not None:
        check_vocab_fits(found, model_vocab)
    return found, f"{reason} ({found.vocab_size} tokens)"


def _bytes_reason(folder: Path, looked_for: tuple[str, ...]) -> str:
    return (
        f"no tokenizer in {str(folder)!r} (looked for {', '.join(looked_for)}): the data are UTF-8 bytes "
        "(vocabulary 256); give one with data.tokenizer=FOLDER"
    )


def check_vocab_fits(tokenizer: TextTokenizer, model_vocab: int) -> None:
    """Refuse a tokenizer that produces ids the model's embedding has no row for.

    Raises:
        ValueError: naming both sizes and the fix.
    """
    if tokenizer.vocab_size > model_vocab:
        raise ValueError(
            f"the tokenizer {tokenizer.source!r} has {tokenizer.vocab_size} tokens but the model's vocabulary holds "
            f"{model_vocab}: use the model's own tokenizer (data.tokenizer=null), or grow the model's vocabulary to "
            f"at least {tokenizer.vocab_size} (model.vocab_size=..., or resize_token_embeddings on the weights)."
        )
