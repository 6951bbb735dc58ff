"""LitGPT's ``GPT`` in the GPT recipe (``model=litgpt model.name=pythia-14m``, ``model=litgpt
model.path=FOLDER``): the litgpt ``Config`` the settings describe, the checks that run before any worker starts,
and the :class:`~lightning_parallel.litgpt.LitGPTCausalLM` each worker trains on the byte-level data, or on data
tokenized by a checkpoint folder's own tokenizer (recipes/finetune_data.py; recipes/finetune.py).

Settings (``LitGPTModelConf``): ``model.name`` a litgpt config name, or ``model.path`` a local litgpt checkpoint
folder (``model_config.yaml``, and ``lit_model.pth`` when it has weights); ``model.config`` fields of that config
to change (``n_layer``, ``block_size``, ...); ``model.vocab_size`` sets ``vocab_size`` and ``padded_vocab_size``
(the byte-level data needs 256).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.recipes.hf import BYTE_VOCAB


def _overrides(m: DictConfig) -> dict[str, Any]:
    fields = OmegaConf.to_container(m.config, resolve=True)
    if m.vocab_size is not None:
        fields.update(vocab_size=m.vocab_size, padded_vocab_size=m.vocab_size)
    return fields


def _source(m: DictConfig) -> str:
    if (m.name is None) == (m.path is None):
        raise ValueError(
            "model=litgpt needs exactly one of model.name (a litgpt config name, e.g. pythia-14m) and model.path "
            "(a local litgpt checkpoint folder with model_config.yaml): set one, null the other."
        )
    if m.path is not None and not (Path(m.path).expanduser() / "model_config.yaml").is_file():
        raise FileNotFoundError(
            f"model.path={m.path!r} is not a litgpt checkpoint folder (no model_config.yaml in it): give a local "
            "folder litgpt wrote (nothing is downloaded)."
        )
    return str(Path(m.path).expanduser()) if m.path is not None else m.name


def litgpt_config(m: DictConfig) -> Any:
    """The litgpt ``Config`` of ``model=litgpt`` with ``model.config`` and ``model.vocab_size`` applied.

    Raises:
        ValueError: neither or both of ``model.name`` and ``model.path``, an unknown name or config field.
        FileNotFoundError: ``model.path`` without a model_config.yaml.
    """
    from litgpt.config import Config

    source, fields = _source(m), _overrides(m)
    try:
        if m.path is not None:
            return Config.from_file(Path(source) / "model_config.yaml", **fields)
        return Config.from_name(source, **fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"model=litgpt: {err} (model.name / model.config)") from None


def check_litgpt_model(cfg: DictConfig) -> None:
    """Refuse, before any worker starts, a model the data cannot use (the family's own keys), and a folder whose
    weights do not fit the model the settings describe."""
    from litgpt.model import GPT

    m = cfg.model
    if m.seq_len < 1:
        raise ValueError(f"model.seq_len={m.seq_len} must be a positive size: set model.seq_len to 1 or more.")
    config = litgpt_config(m)
    if cfg.data.kind == "text" and config.padded_vocab_size < BYTE_VOCAB:
        raise ValueError(
            f"model.vocab_size={config.padded_vocab_size} (the model's vocabulary) does not cover the byte-level "
            f"data's {BYTE_VOCAB} tokens: set model.vocab_size={BYTE_VOCAB} (or more)."
        )
    if m.seq_len > config.block_size:
        raise ValueError(
            f"model.seq_len={m.seq_len} is longer than the model's block_size={config.block_size}: set model.seq_len "
            f"<= {config.block_size} or model.config.block_size >= {m.seq_len}."
        )
    if m.path is not None:
        with torch.device("meta"):
            model = GPT(config)
        _check_weights_fit(model, Path(_source(m)))


def _check_weights_fit(model: Any, folder: Path) -> None:
    """A folder's ``lit_model.pth`` has the shapes of the model the settings describe (read memory-mapped)."""
    weights = folder / "lit_model.pth"
    if not weights.is_file():
        return
    state = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    state = state.get("model", state)
    for name, tensor in model.state_dict().items():
        if name in state and state[name].shape != tensor.shape:
            raise ValueError(
                f"model.path={str(folder)!r} holds {name} of shape {tuple(state[name].shape)}, but model.config / "
                f"model.vocab_size make it {tuple(tensor.shape)}: leave the fields that shape the weights as the "
                "folder's model_config.yaml has them (model.vocab_size=null keeps its vocabulary)."
            )


def build_litgpt_module(cfg: DictConfig) -> Any:
    """The LitGPTCausalLM a worker trains: a folder's weights, or a named config's fresh ones (seeded); with
    ``peft=lora`` LitGPT's own LoRA adapters, drawn from ``seed``, on the frozen base."""
    from lightning_parallel.litgpt import LitGPTCausalLM
    from lightning_parallel.recipes.lora import litgpt_lora_settings, wants_lora

    m = cfg.model
    lora = {"lora": litgpt_lora_settings(cfg.peft), "adapter_seed": cfg.seed} if wants_lora(cfg) else {}
    return LitGPTCausalLM(_source(m), lr=m.lr, weight_decay=m.weight_decay, **lora, **_overrides(m))


def meta_litgpt_module(cfg: DictConfig) -> Any:
    """The LitGPTCausalLM a worker trains, built from its config on the meta device (no weights read), LitGPT's LoRA
    included: what the strategy checks before launch."""
    from lightning_parallel.litgpt import LitGPTCausalLM
    from lightning_parallel.recipes.lora import litgpt_lora_settings, wants_lora

    lora = {"lora": litgpt_lora_settings(cfg.peft), "adapter_seed": cfg.seed} if wants_lora(cfg) else {}
    with torch.device("meta"):
        return LitGPTCausalLM(litgpt_config(cfg.model), **lora)
