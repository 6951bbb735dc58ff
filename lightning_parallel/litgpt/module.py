"""``LitGPTCausalLM``: LitGPT's ``GPT`` as a LightningModule that every layout of this package can split.

The model stays LitGPT's own object (``self.model``: parameter names, ``lit_model.pth`` state dicts and
``GPT.forward`` are untouched); the parallel protocol methods describe it from outside, see
:mod:`lightning_parallel.litgpt.plan` and :mod:`lightning_parallel.litgpt.layers`. The loss is the one
:class:`~lightning_parallel.hf.HFCausalLM` trains with (labels shifted inside, -100 ignored, token mean).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.causal_lm import CausalLM
from lightning_parallel.litgpt.context import check_litgpt_context, litgpt_context_parallel
from lightning_parallel.litgpt.layers import litgpt_pipeline_layers
from lightning_parallel.litgpt.lora import build_lora_gpt, check_lora_degrees, lora_config
from lightning_parallel.litgpt.plan import SP_WITH_PP, litgpt_tensor_parallel_plan
from lightning_parallel.parallel.mesh import ParallelDims

# the checkpoint key of the model's LitGPT config (``dataclasses.asdict``): ``Config(**checkpoint[key])``
LITGPT_CONFIG_KEY = "litgpt_config"
# litgpt's own file names in a checkpoint folder (``litgpt download`` / ``convert_hf_checkpoint`` write them)
CONFIG_FILE, WEIGHTS_FILE = "model_config.yaml", "lit_model.pth"


def read_source(source: Any, **overrides: Any) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """(config, base weights or None) of a ``Config``, a config name or a local checkpoint folder (a ``GPT``: its
    config and state dict).

    A folder holds ``model_config.yaml`` (and ``lit_model.pth``, read when present): what litgpt writes.
    ``overrides`` change fields of a named or folder config (``n_layer=2``), as ``Config.from_name(name,
    **overrides)`` does.
    """
    from litgpt.config import Config
    from litgpt.model import GPT

    if isinstance(source, GPT) or isinstance(source, Config):
        if overrides:
            raise ValueError(
                f"LitGPTCausalLM: config overrides {sorted(overrides)} apply to a config name or folder, not to a "
                f"{type(source).__name__}: change the Config before passing it."
            )
        return (source.config, source.state_dict()) if isinstance(source, GPT) else (source, None)
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if folder.is_dir():
            if not (folder / CONFIG_FILE).is_file():
                raise ValueError(
                    f"LitGPTCausalLM({str(source)!r}): the folder has no {CONFIG_FILE}. Pass a litgpt checkpoint "
                    "folder (this package never downloads), a config name such as 'pythia-14m', a Config or a GPT."
                )
            config = Config.from_file(folder / CONFIG_FILE, **overrides)
            if not (folder / WEIGHTS_FILE).is_file():
                return config, None
            state = torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True, mmap=True)
            return config, state.get("model", state)  # litgpt's training checkpoints nest it
        try:
            return Config.from_name(str(source), **overrides), None
        except ValueError as error:
            if "not a supported config name" not in str(error):
                raise
            raise ValueError(
                f"LitGPTCausalLM({str(source)!r}): neither a local folder nor a litgpt config name. Pass a name "
                "litgpt.config.name_to_config lists (e.g. 'pythia-14m'), a checkpoint folder, a Config or a GPT."
            ) from None
    raise TypeError(
        "LitGPTCausalLM takes a litgpt GPT, a Config, a config name or a checkpoint folder, not "
        f"{type(source).__name__}."
    )


def load_gpt(
    source: Any,
    lora: Mapping[str, Any] | None = None,
    adapter_seed: int = 0,
    build: Callable[[Callable[[], nn.Module]], nn.Module] | None = None,
    **overrides: Any,
) -> nn.Module:
    """A litgpt ``GPT`` as it is, or one built from a ``Config``, a config name or a local checkpoint folder (see
    :func:`read_source`); with LoRA (``lora`` settings, or a ``litgpt.lora`` config or GPT with ``lora_r > 0``) a
    ``litgpt.lora.GPT`` with the base frozen (:func:`~lightning_parallel.litgpt.lora.build_lora_gpt`). A GPT built
    from a config alone (no weights, no LoRA) is ``build(lambda: GPT(config))`` when ``build`` is given (the
    module's meta-device build), else ``GPT(config)`` with its own initialization."""
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import mark_only_lora_as_trainable
    from litgpt.model import GPT

    if isinstance(source, LoRAGPT) and source.config.lora_r > 0:
        if lora is not None:
            raise ValueError(
                "LitGPTCausalLM(lora=...) got a litgpt.lora.GPT that has adapters already: pass lora=None to train "
                "those, or pass its base model (a GPT, Config, name or folder) with the settings."
            )
        mark_only_lora_as_trainable(source)  # its adapters as the caller drew them
        return source
    config, weights = read_source(source, **overrides)
    adapted = lora_config(config, lora)
    if adapted is not None:
        return build_lora_gpt(adapted, weights, adapter_seed)
    if isinstance(source, GPT):
        return source
    if weights is None and build is not None:
        return build(lambda: GPT(config))
    model = GPT(config)
    if weights is not None:
        model.load_state_dict(weights)
    return model


class LitGPTCausalLM(CausalLM):
    """Next-token training of LitGPT's ``GPT`` under any strategy of this package.

    Batches are a tuple ``(input_ids, labels)`` or a dict with ``input_ids`` (and optionally ``labels``; labels
    default to the input ids), as for :class:`~lightning_parallel.hf.HFCausalLM`: labels are shifted inside,
    -100 is ignored, the loss is a token mean per (micro)batch. ``GPT`` takes no attention mask (attention is
    causal): mark padding with ``labels=-100``.

    With LoRA the model is LitGPT's own ``litgpt.lora.GPT`` (its ``LoRALinear`` / ``LoRAQKVLinear`` layers and
    parameter names, ``lora_A`` / ``lora_B``), built and loaded as ``litgpt finetune_lora`` does, the base frozen:
    only the adapters have gradients and optimizer states. ZeRO 0-3, tp (with or without sequence parallelism)
    and pp for now; cp and ep are refused (:mod:`lightning_parallel.litgpt.lora`). Without LoRA, cp splits each sequence
    (:mod:`lightning_parallel.litgpt.context`).

    A model from a config alone (a ``Config``, a name, or a folder without ``lit_model.pth``; no LoRA) is built on the
    meta device and each rank initializes only what it holds once the strategy split it, each module by its own
    ``reset_parameters()`` from a generator seeded by the seed and the module's name (:meth:`CausalLM.materialize`):
    no rank ever holds the whole model, and every layout gets the values one process gets with the same seed.
    Outside a Trainer call :meth:`materialize` first.

    Args:
        model: a ``litgpt.model.GPT``, a ``litgpt.config.Config``, a litgpt config name (``"pythia-14m"``) or a
            local litgpt checkpoint folder (``model_config.yaml``, optionally ``lit_model.pth``). A
            ``litgpt.lora.Config`` or ``litgpt.lora.GPT`` with ``lora_r > 0`` means LoRA with its own settings.
        lora: LitGPT's LoRA settings by their names in ``litgpt.lora.Config`` (and ``litgpt finetune_lora``):
            ``{"lora_r": 8, "lora_alpha": 16, "lora_query": True, "lora_value": True}``; ``lora_dropout``,
            ``lora_key``, ``lora_projection``, ``lora_mlp``, ``lora_head`` as well. None: no adapters (unless
            ``model`` carries them).
        adapter_seed: the seed a LoRA model is drawn from (adapters, and the base where no weights are loaded; the
            global generator is left alone), so every process builds the same adapters.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay, not applied to biases and norm weights (parameters of dimension < 2).
        betas: AdamW betas.
        eps: AdamW epsilon.
        **config_overrides: fields of a named or folder config to change (``n_layer=2``, ``block_size=256``).
    """

    def __init__(
        self,
        model: Any,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        lora: Mapping[str, Any] | None = None,
        adapter_seed: int = 0,
        **config_overrides: Any,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        # from a config alone: built on meta, each module's reset_parameters() once split (CausalLM.materialize)
        build = functools.partial(self.build_on_meta, init_of=lambda gpt: _reset_parameters)
        self.model = load_gpt(model, lora, adapter_seed, build, **config_overrides)
        litgpt_pipeline_layers(self.model)  # installs the pipeline hooks now: inert under GPT.forward

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits (B, T, padded_vocab_size) (split over the vocabulary under tensor parallelism)."""
        self.require_values(" from its config")
        return self.model(input_ids)

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, None]:
        """(input_ids, labels, None) of a dict or tuple batch."""
        if isinstance(batch, dict):
            if batch.get("attention_mask") is not None:
                raise ValueError(
                    "LitGPT's GPT takes no attention_mask (its attention is causal): drop it from the batch and mark "
                    "padding with labels=-100."
                )
            if batch.get("position_ids") is not None:
                raise ValueError(
                    "LitGPT's GPT takes no position_ids: packed batches (several documents a row) would attend across "
                    "their documents; use padded batches (data.packing=false) or unpacked text blocks."
                )
            ids = batch["input_ids"]
            return ids, batch.get("labels", ids), None
        return batch[0], batch[1], None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[LITGPT_CONFIG_KEY] = asdict(self.model.config)  # plain values: read back without unpickling

    # ----- the parallel protocol (lightning_parallel/protocol.py) -----

    def pipeline_layers(self) -> list[nn.Module]:
        return litgpt_pipeline_layers(self.model)

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        self._sequence_parallel = sequence_parallel  # the strategy asks for the plan before the degrees
        plan = litgpt_tensor_parallel_plan(self.model, sequence_parallel)
        return {f"model.{path}": style for path, style in plan.items()}

    @property
    def has_lora(self) -> bool:
        """Whether the model is a ``litgpt.lora.GPT`` with adapters (the base frozen)."""
        return getattr(self.model.config, "lora_r", 0) > 0

    def context_parallel(self, attention: Any, positions: Any) -> list[str]:
        """Under cp > 1: LitGPT's attention and rotary positions per chunk (:mod:`.context`)."""
        return [f"model.{path}" for path in litgpt_context_parallel(self.model, attention, positions)]

    def attention_heads(self) -> int:
        return int(self.model.config.n_head)

    def check_parallel_degrees(self, dims: ParallelDims) -> None:
        if self.has_lora:
            check_lora_degrees(self.model.config, dims)
        check_litgpt_degrees(self.model, dims)
        if dims.pp > 1 and dims.tp > 1 and getattr(self, "_sequence_parallel", False):
            raise ValueError(SP_WITH_PP)


def _reset_parameters(module: nn.Module) -> None:
    """A LitGPT module's own initialization (``GPT(config)`` runs the same in each module's ``__init__``); the GPT's
    own ``reset_parameters()`` rebuilds its rotary tables."""
    module.reset_parameters()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_litgpt_degrees(model: nn.Module, dims: ParallelDims) -> None:
    """Refuse a tp that does not divide the heads, key/value groups or padded vocabulary, a pp beyond the
    blocks, and what the pipeline layers or the plan cannot express (see :func:`litgpt_pipeline_layers`).

    Args:
        model: a litgpt ``GPT``.
        dims: the mesh's degrees (``ParallelDims.of(pp=2, tp=2)`` for a check of a few); under cp the attention it
            cannot run is refused (:func:`check_litgpt_context`).

    Raises:
        ValueError: naming the setting and the fix.
    """
    config, pp, tp = model.config, dims.pp, dims.tp
    if tp > 1:
        if config.latent_attention is not None:
            raise ValueError(
                "tp > 1 does not split LitGPT's multi-head latent attention (config.latent_attention): use tp=1."
            )
        if config.norm_qk and config.norm_qk_type == "olmo2":
            raise ValueError(
                "tp > 1 does not split the q/k norms over all heads of norm_qk_type='olmo2' (each rank holds some "
                "heads): use tp=1."
            )
        sizes = {
            "n_head": config.n_head,
            "n_query_groups": config.n_query_groups,
            "padded_vocab_size": config.padded_vocab_size,
        }
        for name, size in sizes.items():
            if size % tp:
                raise ValueError(
                    f"tp={tp} does not divide the model's {name}={size}: choose tp among {_divisors(size)}"
                    + (" (or set padded_vocab_size / padding_multiple)." if name == "padded_vocab_size" else ".")
                )
    if pp > config.n_layer:
        raise ValueError(
            f"pp={pp} is more pipeline stages than the model's {config.n_layer} blocks (n_layer): use pp <= "
            f"{config.n_layer}."
        )
    if pp > 1:
        # GPT.forward scales the embeddings and caps the logits between layers: no pipeline layer does that
        for name in ("scale_embeddings", "final_logit_softcapping"):
            if getattr(config, name):
                raise ValueError(
                    f"pp={pp} cannot split a LitGPT model with config.{name}={getattr(config, name)!r} (GPT.forward "
                    "applies it outside every layer): use pp=1."
                )
    if dims.cp > 1:
        check_litgpt_context(config, dims)
