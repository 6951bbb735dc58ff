"""The model a simulation runs: the package's own LightningModule for it (the recipe GPT, ``HFCausalLM``,
``LitGPTCausalLM``), built on the meta device, whatever its size; and the protocol object handed to
``parallelize()``, which gives each rank's pieces storage on fake tensors instead of reading or drawing values.

The model kinds are the planner's (``python -m lightning_parallel.plan``): a name under ``conf/model/`` (the recipe
GPTs), a Hugging Face ``config.json`` or a folder holding one, a ``transformers`` config (a dict or a
``PretrainedConfig``), or a LitGPT model name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.materialize import allocate

Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass
class SimulatedModel:
    """A model ready to split.

    Attributes:
        module: the LightningModule with the protocol methods, its tensors on the meta device.
        name: what the reports call it.
        seq_len: tokens per sample.
        make_batch: samples -> (the forward's inputs, the loss's targets), built under the fake mode.
    """

    module: nn.Module
    name: str
    seq_len: int
    make_batch: Callable[[int], Batch]


@contextmanager
def fake_materialize(module: nn.Module, fake_mode: Any) -> Iterator[None]:
    """Within: ``module.materialize(device)`` (the protocol method ``parallelize()`` calls at its step 7) gives every
    tensor still on the meta device (this rank's pieces once split) fake storage on ``device`` under ``fake_mode``:
    shapes, dtypes and sizes, no memory, no values. (The real strategies read a folder or replay the initialization
    there: values a simulation does not need.) Set on the instance, so the module stays itself for every other
    protocol method and every ``isinstance`` check; removed on exit.

    ``parallelize()`` itself runs outside the fake mode: the mesh's own rank tensors must stay real (FSDP2 over a
    tensor-parallel mesh looks ranks up with ``nonzero``, which a fake tensor cannot answer)."""

    def materialize(device: torch.device) -> None:
        with fake_mode:
            allocate(module, device, device)
        if getattr(module, "_seeded_init", None) is not None:  # CausalLM's values to come: none come on fake storage
            module._seeded_init = None  # (its forward refuses to run while they are awaited: require_values)

    module.materialize = materialize
    try:
        yield
    finally:
        del module.materialize


def token_batch(vocab_size: int, seq_len: int) -> Callable[[int], Batch]:
    def make(samples: int) -> Batch:
        ids = torch.zeros(samples, seq_len, dtype=torch.long)
        return (ids,), torch.zeros(samples, seq_len, dtype=torch.long)

    return make


@dataclass(frozen=True)
class Adapters:
    """LoRA on a frozen base, as the planner takes it (``--lora-rank``, ``--lora-base-dtype``) and the recipe's
    ``peft=lora`` builds it: peft's ``LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0,
    target_modules="all-linear")`` (every linear layer but the output head) on a Hugging Face model.

    Attributes:
        rank: the adapters' rank (0: no adapters, every parameter trains).
        base_dtype: the frozen base's dtype (``bfloat16`` / ``float32``; None: as built).
    """

    rank: int = 0
    base_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--lora-rank={self.rank} is not a rank: give 1 or more (0: full training).")
        if self.base_dtype is not None and not self.rank:
            raise ValueError(f"--lora-base-dtype={self.base_dtype} is the frozen base's dtype: add --lora-rank R.")

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0, target_modules=ALL_LINEAR)


ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head (the recipe's default)


def build_model(source: Any, seq_len: int | None = None, adapters: Adapters | None = None) -> SimulatedModel:
    """``source`` (see the module docstring) as a :class:`SimulatedModel` on the meta device; ``seq_len`` None: the
    model's context length; ``adapters``: LoRA on a frozen base (Hugging Face models only)."""
    lora = adapters if adapters is not None and adapters.rank else None
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir() or str(source).endswith(".json"):
            return _hf(_read_hf_config(path), seq_len, path.stem if path.suffix else path.name, lora)
        recipe = _recipe(str(source), seq_len)
        found = recipe if recipe is not None else _litgpt(str(source), seq_len)
        return _no_adapters(found, lora, "a recipe GPT" if recipe is not None else "a LitGPT model")
    from lightning_parallel.models import GPTConfig

    if isinstance(source, GPTConfig):
        return _no_adapters(_recipe_gpt(source, seq_len, "gpt"), lora, "a recipe GPT")
    if isinstance(source, dict):
        return _hf(_config_from_dict(dict(source)), seq_len, source.get("_name_or_path") or "model", lora)
    from transformers import PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return _hf(source, seq_len, source.name_or_path or source.model_type, lora)
    raise TypeError(
        f"simulate: model={type(source).__name__} is not a model to simulate: give a conf/model name, a Hugging Face "
        "config (config.json, its folder, a dict or a PretrainedConfig) or a LitGPT model name."
    )


def _read_hf_config(path: Path) -> Any:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"simulate: {path} holds no config.json: give a Hugging Face model folder or its config.json.")
    return _config_from_dict(json.loads(file.read_text()))


def _config_from_dict(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    kind = raw.pop("model_type", None)
    if kind is None:
        raise ValueError('simulate: the Hugging Face config has no model_type: add it (e.g. "llama").')
    return AutoConfig.for_model(kind, **raw)


def _no_adapters(model: SimulatedModel, adapters: Adapters | None, kind: str) -> SimulatedModel:
    if adapters is not None:
        raise ValueError(
            f"--lora-rank={adapters.rank}: {model.name} is {kind}, and the simulator puts LoRA adapters on Hugging "
            "Face models (HFCausalLM with peft, as the recipe's peft=lora): give the model's config.json or folder, "
            "or drop --lora-rank."
        )
    return model


def _hf(config: Any, seq_len: int | None, name: str, adapters: Adapters | None = None) -> SimulatedModel:
    """``HFCausalLM`` of ``config`` on meta; with ``adapters`` wrapped by peft, its base frozen (and cast), as the
    recipe's ``peft=lora`` builds it (the base has no values: :class:`~lightning_parallel.hf.adapters.BaseIdentity`
    takes no hash of it)."""
    from lightning_parallel.hf import HFCausalLM

    seq = seq_len or getattr(config, "max_position_embeddings", None) or 2048
    lora = {"peft_config": adapters.peft_config(), "base_dtype": adapters.base_dtype} if adapters else {}
    with torch.device("meta"):
        module = HFCausalLM(config, **lora)
    return SimulatedModel(module, name, seq, token_batch(config.vocab_size, seq))


def _recipe(name: str, seq_len: int | None) -> SimulatedModel | None:
    """A recipe GPT of ``conf/model/`` (None when ``name`` is no recipe model); ``seq_len`` replaces its own."""
    from lightning_parallel.models import GPTConfig
    from lightning_parallel.plan import CONF, load_model_config

    if not (name.endswith((".yaml", ".yml")) or (CONF / "model" / f"{name}.yaml").is_file()):
        return None
    kind, m = load_model_config(name)
    if kind != "gpt":
        raise ValueError(f"simulate: {name} is a {kind} model; the simulator runs causal language models for now.")
    moe = {f.name: m[f.name] for f in dataclasses.fields(GPTConfig) if f.name.startswith("moe_")}  # the recipe's
    config = GPTConfig(m.vocab_size, m.seq_len, m.n_layer, m.n_head, m.d_model, m.mlp_ratio, m.dropout, **moe)
    return _recipe_gpt(config, seq_len, Path(name).stem)


def _recipe_gpt(config: Any, seq_len: int | None, name: str) -> SimulatedModel:
    """The recipe's LitGPT of a ``GPTConfig`` (``seq_len`` replacing its own), its GPT built on meta as the
    strategies build it (``configure_model`` under their meta-device context)."""
    from lightning_parallel.models import GPTModule

    config = dataclasses.replace(config, seq_len=seq_len or config.seq_len)
    module = GPTModule(config, build_in_configure_model=True)
    with torch.device("meta"):
        module.configure_model()
    return SimulatedModel(module, name, config.seq_len, token_batch(config.vocab_size, config.seq_len))


def _litgpt(name: str, seq_len: int | None) -> SimulatedModel:
    from lightning_parallel.litgpt import LitGPTCausalLM

    try:
        with torch.device("meta"):
            module = LitGPTCausalLM(name)
    except ValueError as err:
        raise ValueError(
            f"simulate: {name!r} is neither a conf/model name, a Hugging Face config nor a LitGPT model name ({err})."
        ) from err
    config = module.model.config
    seq = seq_len or config.block_size
    if seq > config.block_size:
        module.model.max_seq_length = seq  # LitGPT's rope cache follows it
    return SimulatedModel(module, name, seq, token_batch(config.padded_vocab_size, seq))
