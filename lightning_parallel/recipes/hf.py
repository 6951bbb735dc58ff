"""Hugging Face causal LMs in the GPT recipe (``model=hf_llama_tiny``, ``model=hf_gpt2_tiny``, ``model=hf
model.path=FOLDER``): the transformers config the settings describe, the checks that run before any worker
starts, and the :class:`~lightning_parallel.hf.HFCausalLM` each worker trains on the byte-level data.

Settings (``HFModelConf``): ``model.path`` a local ``save_pretrained`` folder (its weights, or its config.json
alone for fresh weights), else ``model.config`` (``model_type`` and the config's fields); ``model.vocab_size``
overrides the config's vocabulary (not that of a folder with weights). A tokenizer in the folder (or
``data.tokenizer``) tokenizes the data (recipes/finetune_data.py); without one the data are bytes, so the vocabulary
must hold at least 256 ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

BYTE_VOCAB = 256  # the text data's tokens are UTF-8 bytes


def _weights_in(folder: Path) -> bool:
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    return any((folder / name).is_file() for name in names)


def _folder(m: DictConfig) -> Path:
    from transformers.utils import CONFIG_NAME

    folder = Path(m.path).expanduser()
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"model.path={m.path!r} is not a save_pretrained folder (no {CONFIG_NAME} in it): give a local folder "
            "written by model.save_pretrained(...) or config.save_pretrained(...) (nothing is downloaded)."
        )
    return folder


def hf_config(m: DictConfig) -> Any:
    """The transformers ``PretrainedConfig`` of ``model=hf*``, with ``model.vocab_size`` applied.

    Raises:
        ValueError: neither or both of ``model.path`` and ``model.config``, an unknown ``model_type``, a config
            transformers refuses, or a ``model.vocab_size`` that would not fit a folder's weights.
        FileNotFoundError: ``model.path`` without a config.json.
    """
    from transformers import AutoConfig

    fields = OmegaConf.to_container(m.config, resolve=True)
    if (m.path is None) == (not fields):
        raise ValueError(
            "model=hf needs exactly one of model.path=FOLDER (a local save_pretrained folder) and model.config "
            "(model_type and the transformers config's fields, as in conf/model/hf_llama_tiny.yaml)."
        )
    if m.path is not None:
        folder = _folder(m)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if m.vocab_size is not None and m.vocab_size != config.vocab_size and _weights_in(folder):
            raise ValueError(
                f"model.vocab_size={m.vocab_size} differs from the vocab_size={config.vocab_size} of the weights in "
                f"model.path={m.path!r}: leave model.vocab_size unset (null) to train those weights."
            )
    else:
        if "model_type" not in fields:
            raise ValueError("model.config needs model_type (e.g. llama or gpt2): add model.config.model_type=...")
        try:
            config = AutoConfig.for_model(**fields)
        except (ValueError, TypeError) as err:  # transformers' own validation (huggingface_hub's is a ValueError)
            raise ValueError(f"model.config is not a valid transformers config: {err}") from None
    if m.vocab_size is not None:
        config.vocab_size = m.vocab_size
    return config


def _positions(config: Any) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_hf_model(cfg: DictConfig) -> None:
    """Refuse, before any worker starts, a model the data cannot use (the family's own keys)."""
    m = cfg.model
    if m.seq_len < 1:
        raise ValueError(f"model.seq_len={m.seq_len} must be a positive size: set model.seq_len to 1 or more.")
    config = hf_config(m)
    vocab = config.vocab_size
    if cfg.data.kind == "text" and vocab < BYTE_VOCAB:
        raise ValueError(
            f"model.vocab_size={vocab} (the model's vocabulary) does not cover the byte-level data's {BYTE_VOCAB} "
            f"tokens: set model.vocab_size={BYTE_VOCAB} (or more)."
        )
    positions = _positions(config)
    if positions is not None and m.seq_len > positions:
        raise ValueError(
            f"model.seq_len={m.seq_len} is longer than the model's {positions} positions: set model.seq_len <= "
            f"{positions}."
        )
    _check_attention(config, cfg.trainer.accelerator)


def _check_attention(config: Any, accelerator: str) -> None:
    """FlashAttention kernels run on CUDA GPUs only: refuse them for a CPU run before any worker starts."""
    impl = getattr(config, "_attn_implementation", None) or ""
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if impl.startswith("flash_attention") and on_cpu:
        raise ValueError(
            f"model.config.attn_implementation={impl} runs on CUDA GPUs only, and this run is on CPU "
            f"(trainer.accelerator={accelerator}): set model.config.attn_implementation=sdpa (or eager)."
        )


def build_hf_module(cfg: DictConfig) -> Any:
    """The HFCausalLM a worker trains: a folder's weights, or fresh weights from the config (seeded); with
    ``peft=lora`` LoRA adapters drawn from ``seed`` on the frozen base."""
    from lightning_parallel.hf import HFCausalLM

    m = cfg.model
    config = hf_config(m)
    source = m.path if m.path is not None and _weights_in(_folder(m)) else config
    return HFCausalLM(source, lr=m.lr, weight_decay=m.weight_decay, **_adapters(cfg, config))


def meta_hf_module(cfg: DictConfig) -> Any:
    """The HFCausalLM a worker trains, built from its config on the meta device (no memory, no weights read), its
    LoRA adapters included: what the strategy checks before launch."""
    from lightning_parallel.hf import HFCausalLM

    m = cfg.model
    config = hf_config(m)
    try:
        with torch.device("meta"):
            return HFCausalLM(config, lr=m.lr, weight_decay=m.weight_decay, **_adapters(cfg, config))
    except ImportError as err:  # an attention implementation whose package is missing
        raise ValueError(f"{err} Set model.config.attn_implementation=sdpa (or eager).") from None


def _adapters(cfg: DictConfig, config: Any) -> dict[str, Any]:
    """HFCausalLM's LoRA arguments for ``peft=lora`` (none without it)."""
    from lightning_parallel.recipes.lora import base_dtype_kwargs, lora_config, wants_lora

    if not wants_lora(cfg):
        return {}
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # what the adapters' settings depend on (GPT-2's Conv1D), allocating nothing
        meta = AutoModelForCausalLM.from_config(config)
    return {"peft_config": lora_config(cfg.peft, meta), "adapter_seed": cfg.seed, **base_dtype_kwargs(cfg.peft)}
