"""Checkpoints of LoRA training (``HFCausalLM(peft_config=...)``): the adapters, not the base.

A save holds the trainable tensors (peft's adapters) and their optimizer states; the frozen base is named instead of
copied: its folder and a sha256 (over the folder's safetensors files' bytes; over the base's tensors when the model
was not read from a folder), with peft's config, under the checkpoint key ``peft``. The module decides what is
left out (:meth:`HFCausalLM.unsaved_state_keys`: every state-dict key but the trainable ones) and every save path
(sharded, one file, Lightning's own strategies) goes through its ``on_save_checkpoint``; loads ask the same module
(:mod:`lightning_parallel.parallel.checkpoint.selection`). Resuming checks the base first and refuses another one.

Export, in one process, from any checkpoint of such a run (a sharded folder is consolidated):

    python -m lightning_parallel.checkpoint export-peft CKPT OUT       # adapter_config.json, adapter_model.safetensors
    python -m lightning_parallel.checkpoint export-hf CKPT OUT --merge  # base + adapters merged, for from_pretrained

``export-peft`` uses peft's own ``save_pretrained`` (peft's key names, ``PeftModel.from_pretrained(base, OUT)`` loads
it) on a model built on the meta device: the base is neither read nor copied. ``--merge`` reads the base the
checkpoint names (checked against its hash), adds the adapters and writes ``merge_and_unload()``'s model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_parallel._compat import is_fake_tensor

PEFT_KEY = "peft"  # checkpoint key: {"config": peft config as JSON, "base": {"path", "sha256", "over"}}
OVER_FILES, OVER_TENSORS = "safetensors files", "tensors"
PREFIX = "model."  # HFCausalLM keeps the PeftModel as self.model


def folder_sha256(folder: str | Path) -> str:
    """sha256 over the bytes of a ``save_pretrained`` folder's safetensors files, in name order."""
    digest = hashlib.sha256()
    for file in sorted(Path(folder).glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def tensors_sha256(model: nn.Module) -> str:
    """sha256 over a model's state (names in order, dtypes, shapes, bytes): for a base not read from a folder."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype (bf16 too), as raw bytes
    return digest.hexdigest()


def without_values(model: nn.Module) -> list[str]:
    """The names of ``model``'s state tensors that hold no values: on the meta device or fake (``FakeTensor``, a
    simulation's), each a DTensor's local piece when it is one."""
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        local = getattr(tensor, "_local_tensor", tensor)
        if local.is_meta or is_fake_tensor(local):
            out.append(name)
    return out


class BaseIdentity:
    """What a LoRA checkpoint names its base by. A folder's hash is taken when first asked for (then kept); a
    model given as an object is hashed now, before any strategy splits it.

    The rule for a base without values (built on the meta device, or on fake tensors by the simulator,
    :mod:`lightning_parallel.simulate`): when any of its tensors is meta or fake it is not hashed (there is nothing
    to hash, and reading it would fail), and :meth:`record` (every adapter save and every resume asks for it)
    refuses, naming the tensor and the fix. A base with values, or a folder, is hashed as before: no real run saves
    adapters without their base's hash.

    Args:
        source: what ``HFCausalLM`` was built from (a folder, a model or a config).
        model: the Hugging Face model built from it, before peft wraps it.
    """

    def __init__(self, source: Any, model: nn.Module) -> None:
        folder = isinstance(source, (str, Path)) and Path(source).is_dir() and any(Path(source).glob("*.safetensors"))
        self.path = str(Path(source).resolve()) if folder else None
        self.valueless = [] if folder else without_values(model)
        self._sha256 = None if folder or self.valueless else tensors_sha256(model)

    def record(self) -> dict[str, Any]:
        """``{"path", "sha256", "over"}``.

        Raises:
            ValueError: the base was built without values (meta or fake tensors), so it has no hash.
        """
        if self.valueless:
            raise ValueError(
                f"the LoRA base was built without values ({self.valueless[0]} is on the meta device or fake), so "
                "adapters saved from it could not name their base by a hash: build HFCausalLM from a "
                "save_pretrained folder (hashed over its files) or from a model with weights."
            )
        if self._sha256 is None:
            self._sha256 = folder_sha256(self.path)
        return {"path": self.path, "sha256": self._sha256, "over": OVER_FILES if self.path else OVER_TENSORS}


def _describe(base: dict[str, Any]) -> str:
    where = base["path"] or "a model given as an object (no folder)"
    return f"{where} (sha256 {base['sha256'][:16]}... over its {base['over']})"


def check_same_base(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse adapters saved on another base than this module's.

    Raises:
        ValueError: naming both bases and their hashes, and the fix.
    """
    if (saved["sha256"], saved["over"]) == (current["sha256"], current["over"]):
        return
    raise ValueError(
        f"the checkpoint's LoRA adapters were trained on the base {_describe(saved)}, but this HFCausalLM's base is "
        f"{_describe(current)}: adapters fit only the base they were trained on. Build HFCausalLM from "
        f"{saved['path'] or 'the same model'} (or a copy with the same weights), or start without ckpt_path."
    )


def save_record(config: Any, base: BaseIdentity) -> dict[str, Any]:
    """The checkpoint's ``peft`` entry: plain values only (a checkpoint loads as weights only)."""
    settings = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return {"config": json.dumps(settings, default=str), "base": base.record()}


def adapter_record(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The ``peft`` entry of a checkpoint of a LoRA run.

    Raises:
        ValueError: a checkpoint without adapters, naming export-hf for it.
    """
    record = checkpoint.get(PEFT_KEY)
    if record is None:
        raise ValueError(
            "the checkpoint holds no LoRA adapters (it was not saved by HFCausalLM(peft_config=...)): export its "
            "whole model with export-hf."
        )
    return record


def peft_config_of(record: dict[str, Any]) -> Any:
    """peft's config object saved in a checkpoint's ``peft`` entry."""
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**json.loads(record["config"]))


def adapter_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors under the ``PeftModel``'s own names (HFCausalLM's ``model.`` stripped)."""
    state = checkpoint.get("state_dict") or {}
    out = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
    if not out:
        raise ValueError(
            "the checkpoint holds no adapter tensors (state_dict is empty): give one a training run saved."
        )
    return out


def merged_model(checkpoint: dict[str, Any], config: Any, base: str | Path | None = None) -> nn.Module:
    """The base the checkpoint names (or ``base``; checked against the saved hash) with the checkpoint's adapters
    merged into it (peft's ``merge_and_unload``): a plain transformers model.

    Raises:
        ValueError: no base folder to read, or one with another hash.
    """
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    record = adapter_record(checkpoint)
    folder = base or record["base"]["path"]
    if folder is None or not Path(folder).is_dir():
        where = f"{folder}, is not a folder here" if folder else "was given as an object (no folder)"
        raise ValueError(
            f"--merge needs the base the adapters were trained on, which {where}: pass --base FOLDER, a "
            "save_pretrained folder of that base (its hash is checked)."
        )
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    found = BaseIdentity(folder, hf).record()
    if record["base"]["over"] == OVER_TENSORS:
        found = {**found, "sha256": tensors_sha256(hf), "over": OVER_TENSORS}
    check_same_base(record["base"], found)
    model = get_peft_model(hf, peft_config_of(record))
    state = adapter_state(checkpoint)
    missing, unexpected = model.load_state_dict(state, strict=False)  # the adapters; the base is the folder's
    unfilled = [k for k in missing if "lora_" in k]
    if unexpected or unfilled:
        raise ValueError(f"the checkpoint's adapters do not fit its config: {(unexpected or unfilled)[:3]}.")
    return model.merge_and_unload()
