"""A checkpoint of :class:`~lightning_parallel.hf.HFCausalLM` as a Hugging Face folder:

    python -m lightning_parallel.checkpoint export-hf CKPT OUT_DIR [--merge]

writes what ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads (config.json, model.safetensors,
generation_config.json), with HF's own ``save_pretrained``. CKPT is any checkpoint this package or Lightning
wrote (a sharded folder is consolidated in this process); the model's transformers config comes from the
checkpoint (HFCausalLM saves it under ``hf_config``), or from ``--config FOLDER`` for a checkpoint without it.
The weights are the checkpoint's ``state_dict`` without HFCausalLM's ``model.`` prefix; tied weights (GPT-2's
embedding and head) are checked to be equal and saved once, as HF saves them. A checkpoint of LoRA training holds
the adapters only: ``--merge`` writes the base it names with them merged (:mod:`lightning_parallel.hf.adapters`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.hf.adapters import PEFT_KEY, adapter_record, adapter_state, merged_model, peft_config_of
from lightning_parallel.hf.module import HF_CONFIG_KEY
from lightning_parallel.parallel.checkpoint.consolidate import check_checkpoint_path, consolidated

PREFIX = "model."  # HFCausalLM keeps the HF model as self.model


def hf_config_of(checkpoint: dict[str, Any], config_folder: str | Path | None = None) -> Any:
    """The transformers config saved in ``checkpoint``, or the one in ``config_folder`` (which wins).

    Raises:
        ValueError: neither holds one, naming ``--config``.
    """
    from transformers import AutoConfig

    if config_folder is not None:
        if not (Path(config_folder) / "config.json").is_file():
            raise FileNotFoundError(
                f"--config {config_folder}: no config.json in it: give the folder save_pretrained wrote for the model."
            )
        return AutoConfig.from_pretrained(config_folder, local_files_only=True)
    saved = checkpoint.get(HF_CONFIG_KEY)
    if saved is None:
        raise ValueError(
            f"the checkpoint holds no Hugging Face config ({HF_CONFIG_KEY!r}): it was not saved by HFCausalLM. "
            "Pass --config FOLDER, a folder holding the model's config.json (e.g. config.save_pretrained(FOLDER))."
        )
    saved = dict(saved)
    return AutoConfig.for_model(saved.pop("model_type"), **saved)


def hf_state_dict(checkpoint: dict[str, Any]) -> dict[str, Tensor]:
    """The checkpoint's weights under the HF model's own names (HFCausalLM's ``model.`` prefix stripped).

    Raises:
        ValueError: no ``state_dict``, or keys outside ``model.`` (not an HFCausalLM checkpoint).
    """
    state = checkpoint.get("state_dict")
    if not state:
        raise ValueError("the checkpoint holds no state_dict (model weights): give a checkpoint a training run saved.")
    other = [k for k in state if not k.startswith(PREFIX)]
    if other:
        raise ValueError(
            f"the checkpoint's weights are not all under {PREFIX!r} (e.g. {other[0]!r}): export-hf takes checkpoints "
            "of HFCausalLM, whose Hugging Face model is self.model."
        )
    return {k[len(PREFIX) :]: v for k, v in state.items()}


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """State-dict keys of the model that name one tensor (tied weights), grouped."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups[id(tensor)].append(name)
    return list(groups.values())


def load_into(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load ``state`` into the HF ``model``: every key known, every tensor given once, tied copies equal.

    Raises:
        ValueError: unknown or missing keys, or tied weights that differ in the checkpoint.
    """
    groups = _tied_groups(model)
    known = {name for group in groups for name in group}
    unknown = sorted(set(state) - known)
    if unknown:
        raise ValueError(f"the checkpoint has weights the config's model lacks: {unknown[:5]}: is --config right?")
    for group in groups:
        present = [name for name in group if name in state]
        if not present:
            raise ValueError(f"the checkpoint lacks the weights {group}: is it a checkpoint of this model?")
        if any(not torch.equal(state[present[0]], state[name]) for name in present[1:]):
            raise ValueError(
                f"the config ties {present} but the checkpoint holds different values for them: untie them in the "
                "config (e.g. tie_word_embeddings=false) with --config, or save them tied."
            )
    # a tied copy the checkpoint lacks gets its partner's values (one tensor: loading it twice changes nothing)
    full = {name: state[next(n for n in group if n in state)] for group in groups for name in group}
    model.load_state_dict(full, strict=True)


def read_checkpoint(ckpt: str | Path, out: Path, config_folder: str | Path | None) -> tuple[dict[str, Any], Any]:
    """The checkpoint ``ckpt`` consolidated in this process, and its transformers config, once ``out`` is known to
    be a new or empty folder (every export checks both before it writes).

    Raises:
        ValueError: ``out`` holds something, or no config (naming ``--config``).
    """
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"OUT_DIR {out} exists and is not an empty folder: give a new folder to write the model in.")
    check_checkpoint_path(ckpt, "CKPT")
    checkpoint = consolidated(ckpt)
    return checkpoint, hf_config_of(checkpoint, config_folder)


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    config_folder: str | Path | None = None,
    merge: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Write the HFCausalLM checkpoint ``ckpt`` as a Hugging Face folder ``out`` (see the module's docstring).

    Args:
        ckpt: a checkpoint file or sharded checkpoint folder.
        out: a new (or empty) folder.
        config_folder: a folder with the model's config.json, for a checkpoint that holds none.
        merge: a LoRA checkpoint (adapters only): merge them into the base it names
            (:func:`~lightning_parallel.hf.adapters.merged_model`).
        base: with ``merge``, the base's folder when it is no longer where the checkpoint says.

    Returns:
        ``out``.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out)
    checkpoint, config = read_checkpoint(ckpt, out, config_folder)
    if merge or PEFT_KEY in checkpoint:
        if not merge:
            raise ValueError(
                "the checkpoint holds LoRA adapters, not the whole model: pass --merge (the adapters merged into the "
                "base it names), or use export-peft for a folder peft loads."
            )
        merged_model(checkpoint, config, base).save_pretrained(out)
        return out
    state = hf_state_dict(checkpoint)
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = floats[0] if floats else torch.float32  # the trained dtype (bf16-true stays bf16)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    load_into(model, state)
    model.save_pretrained(out)
    return out


def export_peft(ckpt: str | Path, out: str | Path, config_folder: str | Path | None = None) -> Path:
    """Write a LoRA run's checkpoint as a folder ``PeftModel.from_pretrained(base, out)`` loads.

    Args:
        ckpt: a checkpoint file or sharded checkpoint folder of ``HFCausalLM(peft_config=...)``.
        out: a new (or empty) folder.
        config_folder: a folder with the base's config.json, for a checkpoint that holds none.

    Returns:
        ``out``.
    """
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    checkpoint, config = read_checkpoint(ckpt, Path(out), config_folder)
    record = adapter_record(checkpoint)
    peft_config = peft_config_of(record)
    peft_config.base_model_name_or_path = record["base"]["path"]
    with torch.device("meta"):  # shapes only: the base is never read, and peft saves the tensors given
        model = get_peft_model(AutoModelForCausalLM.from_config(config), peft_config)
    state = adapter_state(checkpoint)
    missing = sorted(k for k in model.state_dict() if "lora_" in k and k not in state)
    if missing:
        raise ValueError(f"the checkpoint lacks adapter tensors {missing[:3]}: is it a checkpoint of this run?")
    model.save_pretrained(out, state_dict=state, save_embedding_layers=False)
    return Path(out)
