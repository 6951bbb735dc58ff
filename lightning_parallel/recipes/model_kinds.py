"""The recipes' model families as registered entries: ``model.kind`` (``gpt``, ``vgg``, ``hf``, ``litgpt``, or one
registered with :func:`register_model_kind`) names a :class:`ModelKind`, which says how to check the family's own
settings, build the module a worker trains, build it on the meta device for the strategy's check before launch, count
its pipeline layers, tokenize its data and plan it. The recipes ask the entry; nothing looks at which keys a model
config has, except :func:`infer_kind`, once, for a config written before ``model.kind`` existed.

A family of your own (docs/recipes.md)::

    from lightning_parallel.recipes.model_kinds import ModelKind, register_model_kind

    MY_KIND = register_model_kind(ModelKind("mlp", recipe="text", schema=MLPConf, check=check_mlp, build=build_mlp))

and ``model.kind=mlp`` in a YAML extending ``mlp_schema``. The recipe's workers are new processes: name the entry
by its import path (``model.kind=my_package.models.MY_KIND``) unless their entry module imports yours.

A family inside this package registers itself in its own module ``lightning_parallel/recipes/<name>_model.py``
(its schema, checks, build and ``register_model_kind(...)``): importing this module imports every such module
(:func:`discover_model_kinds`), so the recipe scripts (through :func:`register_configs`, before Hydra composes
``conf/model/<name>*.yaml``) and their workers find it with no line here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from lightning_parallel import recipes
from lightning_parallel.recipes import config, gpt_model, hf, litgpt, vgg_model
from lightning_parallel.recipes.config import GPTModelConf, HFModelConf, LitGPTModelConf, VGGModelConf
from lightning_parallel.recipes.specs import gpt_spec, vgg_spec
from lightning_parallel.strategies.checks import as_built

RECIPES = {"text": "recipes/train_gpt.py or recipes/finetune.py", "image": "recipes/train_vgg.py"}


def _meta_build(kind: ModelKind, cfg: DictConfig) -> Any:
    with torch.device("meta"):
        return kind.build(cfg)


def pipeline_layer_count(module: Any) -> int:
    """The pipeline layers of ``module`` as its ``configure_model`` builds them (on meta): what pp stages cut."""
    built = as_built(module)
    return len((built if built is not None else module).pipeline_layers())


@dataclass(frozen=True)
class ModelKind:
    """One model family of the recipes.

    Args:
        name: the ``model.kind`` value.
        recipe: ``"text"`` (train_gpt.py, finetune.py: token windows) or ``"image"`` (train_vgg.py).
        build: ``build(cfg)``: the LightningModule a worker trains.
        check: ``check(cfg)``: the family's own settings (``model.*``, and what the data need of the model),
            before the strategy exists; raises naming the setting and the fix.
        schema: the dataclass its YAMLs extend (stored as ``model/<name>_schema``); None: stored already.
        meta: ``meta(cfg)``: the module the strategy checks before launch, without weights (default: ``build``
            under ``torch.device("meta")``).
        check_layout: ``check_layout(cfg, dims)``: the family's settings against the layout's degrees, when its
            own words say more than the strategy's check (the recipe GPT: ``model.moe_experts`` and ``strategy.ep``).
        layers: ``layers(module)``: its pipeline layers (default: those of the module as built, on meta).
        vocab_size: ``vocab_size(m)``: the ids the model takes (text); None: no vocabulary.
        tokenizer_folder: ``tokenizer_folder(m)``: the folder whose tokenizer tokenizes the data (or None);
            a family without it trains on bytes (``data=text/tokens``) only.
        labels_are_inputs: the module shifts the labels itself (batches are ``(ids, ids)``).
        attention_mask: tokenized batches carry an attention mask (False: padding marked by labels only).
        no_packing: why ``data.packing=true`` (several samples a row) is refused ("model=x: ..."); "": taken.
        lora: ``peft=lora`` is taken (the module builds its adapters from ``cfg.peft``).
        plan: ``plan(m, lora_rank)``: the planner's ``ModelSpec`` (``strategy=auto``); None: not planned.
    """

    name: str
    recipe: str
    build: Callable[[DictConfig], Any]
    check: Callable[[DictConfig], None]
    schema: type | None = None
    meta: Callable[[DictConfig], Any] | None = None
    check_layout: Callable[[DictConfig, Any], None] | None = None
    layers: Callable[[Any], int] = pipeline_layer_count
    vocab_size: Callable[[DictConfig], int] | None = None
    tokenizer_folder: Callable[[DictConfig], str | None] | None = None
    labels_are_inputs: bool = False
    attention_mask: bool = True
    no_packing: str = ""
    lora: bool = False
    plan: Callable[..., Any] | None = None

    def meta_module(self, cfg: DictConfig) -> Any:
        """The module the workers will train, on the meta device (no memory, no weights read)."""
        return self.meta(cfg) if self.meta is not None else _meta_build(self, cfg)

    @property
    def tokenized(self) -> bool:
        """Its data may be tokenized by a tokenizer (data=hf_text/sft, or a folder's own on data=text)."""
        return self.tokenizer_folder is not None


MODEL_KINDS: dict[str, ModelKind] = {}


def register_model_kind(kind: ModelKind) -> ModelKind:
    """Add ``kind`` to the recipes' families (its schema to Hydra's ConfigStore as ``model/<name>_schema``);
    returns it. A name taken by another entry is refused."""
    if kind.recipe not in RECIPES:
        raise ValueError(f"ModelKind(recipe={kind.recipe!r}) is unknown: use one of {', '.join(RECIPES)}.")
    known = MODEL_KINDS.get(kind.name)
    if known is not None and known is not kind:
        raise ValueError(f"model.kind={kind.name!r} is registered already: register yours under another name.")
    MODEL_KINDS[kind.name] = kind
    _store_schema(kind)
    return kind


def _store_schema(kind: ModelKind) -> None:
    if kind.schema is not None:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(group="model", name=f"{kind.name}_schema", node=kind.schema)


def register_configs() -> None:
    """What a recipe script calls before Hydra composes: the recipes' schemas (``recipes/config.py``) and every
    registered family's model schema (``model/<kind>_schema``), this package's ``recipes/*_model.py`` included."""
    config.register_configs()
    for kind in MODEL_KINDS.values():
        _store_schema(kind)


def discover_model_kinds() -> None:
    """Import each ``lightning_parallel/recipes/<name>_model.py``: a family in the package registers itself there."""
    for module in pkgutil.iter_modules(recipes.__path__):
        if module.name.endswith("_model"):
            importlib.import_module(f"{recipes.__name__}.{module.name}")


def _names() -> str:
    return ", ".join(MODEL_KINDS)


def model_kind(name: str) -> ModelKind:
    """The entry ``model.kind=name`` names: a registered name, or the import path of a ModelKind (registered then)."""
    if name in MODEL_KINDS:
        return MODEL_KINDS[name]
    module, _, attr = name.rpartition(".")
    entry = None
    if module:
        try:
            entry = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            entry = None
    if not isinstance(entry, ModelKind):
        raise ValueError(
            f"model.kind={name!r} is unknown: use one of {_names()}, or the import path of a ModelKind "
            "(model.kind=my_package.models.MY_KIND; lightning_parallel.recipes.model_kinds.register_model_kind)."
        )
    return MODEL_KINDS.get(entry.name) or register_model_kind(entry)


def infer_kind(m: DictConfig) -> str:
    """The kind of a model config without ``model.kind`` (written before it existed), by the one rule the recipes
    used: ``name``, ``path`` and ``config`` -> litgpt; ``path`` and ``config`` -> hf; ``n_layer`` -> gpt; ``width``
    and ``image_size`` -> vgg. Anything else is refused."""
    keys = set(m.keys())
    for kind, needs in (("litgpt", {"name", "path", "config"}), ("hf", {"path", "config"})):
        if needs <= keys:
            return kind
    if "n_layer" in keys:
        return "gpt"
    if {"width", "image_size"} <= keys:
        return "vgg"
    raise ValueError(
        f"the model config has no model.kind and its keys ({', '.join(sorted(keys))}) name no family: set "
        f"model.kind= one of {_names()} (or the import path of a registered ModelKind)."
    )


def resolve_model_kind(cfg: DictConfig, recipe: str) -> ModelKind:
    """The entry of ``cfg.model``; a missing ``model.kind`` is inferred (:func:`infer_kind`) and written into
    ``cfg`` once, so the workers read it. Refuses a family of another recipe.

    Args:
        cfg: the composed recipe config.
        recipe: ``"text"`` or ``"image"``: the recipe asking.
    """
    m = cfg.model
    name = m.get("kind") or infer_kind(m)
    if m.get("kind") != name:
        with open_dict(cfg):
            m.kind = name
    kind = model_kind(name)
    if kind.recipe != recipe:
        raise ValueError(f"model.kind={name} is trained by {RECIPES[kind.recipe]}, not by this recipe: run that one.")
    return kind


def kind_of(m: DictConfig) -> ModelKind:
    """The entry of a model config resolved already (:func:`resolve_model_kind`), as the workers and data read it."""
    if not m.get("kind"):
        raise ValueError("the model config has no model.kind: set model.kind= one of " + _names() + ".")
    return model_kind(m.kind)


def _hf_shape(m: DictConfig, lora_rank: int = 0) -> Any:
    from pathlib import Path

    from lightning_parallel.planning.hf_config import from_hf_config

    config = hf.hf_config(m)
    return from_hf_config(config.to_dict(), name=Path(m.path or config.model_type).name)


def _litgpt_shape(m: DictConfig, lora_rank: int = 0) -> Any:
    from lightning_parallel.planning.hf_config import litgpt_shape

    return litgpt_shape(litgpt.litgpt_config(m))


def _text_vocab(m: DictConfig) -> int:
    return m.vocab_size


def _folder(m: DictConfig) -> str | None:
    return m.get("path")


GPT = register_model_kind(
    ModelKind(
        "gpt",
        recipe="text",
        build=gpt_model.build_gpt_module,
        check=gpt_model.check_gpt_model,
        schema=GPTModelConf,
        meta=gpt_model.build_gpt_module,  # its GPT is built in configure_model: nothing is allocated before
        check_layout=gpt_model.check_gpt_layout,
        vocab_size=_text_vocab,
        plan=lambda m, lora_rank=0: gpt_spec(m, lora_rank),
    )
)
VGG = register_model_kind(
    ModelKind(
        "vgg",
        recipe="image",
        build=vgg_model.build_vgg_module,
        check=vgg_model.check_vgg_model,
        schema=VGGModelConf,
        meta=vgg_model.build_vgg_module,  # its VGG is built in configure_model: nothing is allocated before
        plan=lambda m, lora_rank=0: vgg_spec(m),
    )
)
HF = register_model_kind(
    ModelKind(
        "hf",
        recipe="text",
        build=hf.build_hf_module,
        check=hf.check_hf_model,
        schema=HFModelConf,
        meta=hf.meta_hf_module,
        vocab_size=lambda m: hf.hf_config(m).vocab_size,
        tokenizer_folder=_folder,
        labels_are_inputs=True,
        lora=True,
        plan=_hf_shape,
    )
)
LITGPT = register_model_kind(
    ModelKind(
        "litgpt",
        recipe="text",
        build=litgpt.build_litgpt_module,
        check=litgpt.check_litgpt_model,
        schema=LitGPTModelConf,
        meta=litgpt.meta_litgpt_module,
        vocab_size=lambda m: litgpt.litgpt_config(m).padded_vocab_size,
        tokenizer_folder=_folder,
        labels_are_inputs=True,
        attention_mask=False,  # its attention is causal: padding is marked by labels -100
        no_packing="model=litgpt*: LitGPT's GPT takes no position_ids and no block mask, so packed samples would "
        "attend to each other",
        lora=True,
        plan=_litgpt_shape,
    )
)

discover_model_kinds()  # the package's own families in their own modules (recipes/<name>_model.py)
