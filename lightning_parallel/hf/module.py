"""``HFCausalLM``: a Hugging Face causal LM as a LightningModule that every layout of this package can split.

The model stays HF's own object (``self.model``: parameter names, ``save_pretrained`` and HF's forward are
untouched); the parallel protocol methods read HF's own descriptions of it (``base_model_tp_plan``, ``_tp_plan``,
``base_model_pp_plan``) through the model's family (:mod:`lightning_parallel.hf.families`: one entry per
``config.model_type``; an unregistered one is refused when the module is built).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.causal_lm import CausalLM
from lightning_parallel.hf.adapters import PEFT_KEY, BaseIdentity, check_same_base, save_record
from lightning_parallel.hf.context import hf_attention_heads, hf_context_parallel
from lightning_parallel.hf.experts import as_loss_like, router_aux_of
from lightning_parallel.hf.families import (
    HFFamily,
    check_hf_degrees,
    hf_expert_plan,
    hf_family,
    hf_pipeline_layers,
    hf_tensor_parallel_plan,
)
from lightning_parallel.hf.init import hf_init_weights
from lightning_parallel.hf.loading import load_local_weights, parameters_on_meta, safetensors_files, tied_aliases
from lightning_parallel.hf.lora import apply_peft, base_of, cast_frozen_base, check_peft_degrees, resolve_base_dtype
from lightning_parallel.hf.moe_pipeline import pipeline_router_aux
from lightning_parallel.hf.plan import SP_WITH_PP
from lightning_parallel.parallel.mesh import ParallelDims

# the checkpoint key of the model's transformers config (``config.to_dict()``): what export-hf rebuilds it from
HF_CONFIG_KEY = "hf_config"


def lazy_causal_lm(source: Any) -> nn.Module | None:
    """For a local folder with safetensors weights: its model with the parameters on the meta device (buffers
    real, dtype the folder's, as ``from_pretrained`` gives), to be filled by :func:`load_local_weights`; else
    None."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(source, (str, Path)) or not Path(source).is_dir() or safetensors_files(source) is None:
        return None
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)


def config_alone(source: Any) -> Any:
    """The transformers config of a source that has no weights (a ``PretrainedConfig``, or a local folder holding a
    config.json and no weights files), else None."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.utils import (
        CONFIG_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    if isinstance(source, PretrainedConfig):
        return source
    if not isinstance(source, (str, Path)) or not (Path(source) / CONFIG_NAME).is_file():
        return None
    weights = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if any((Path(source) / name).is_file() for name in weights):
        return None
    return AutoConfig.from_pretrained(source, local_files_only=True)


def fresh_causal_lm(config: Any) -> nn.Module:
    """The causal LM of a transformers config, with fresh weights (on the meta device inside ``torch.device("meta")``,
    where transformers skips its initialization)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def load_causal_lm(source: Any) -> nn.Module:
    """A ``PreTrainedModel`` as it is, one loaded from a local folder (no network), or one built from a config."""
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        return source
    if isinstance(source, PretrainedConfig):
        return fresh_causal_lm(source)
    if isinstance(source, (str, Path)):
        if config_alone(source) is not None:  # a folder holding a config alone: fresh weights
            return fresh_causal_lm(config_alone(source))
        if not Path(source).is_dir():
            raise ValueError(
                f"HFCausalLM({str(source)!r}): no such folder. Pass a local folder written by save_pretrained (this "
                "package never downloads), a transformers config, or a PreTrainedModel."
            )
        return AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    raise TypeError(
        f"HFCausalLM takes a PreTrainedModel, a local folder or a PretrainedConfig, not {type(source).__name__}."
    )


class HFCausalLM(CausalLM):
    """Next-token training of a Hugging Face causal LM (Llama-style models, GPT-2) under any strategy.

    Batches are a dict with ``input_ids`` (and optionally ``labels``, ``attention_mask``, ``position_ids``; labels
    default to the input ids) or a tuple ``(input_ids, labels)``: padded and packed batches
    (:mod:`lightning_parallel.text`) under every layout but cp (there: unpadded rows; the attention and positions
    switched by :meth:`context_parallel`). The training loss is a mean over the global batch's real tokens
    (:meth:`~lightning_parallel.causal_lm.CausalLM.loss`).

    A folder with safetensors weights is not read here: the parameters are built on the meta device and each
    rank reads only what it holds once the strategy split the model (its stages, its tensor-parallel and ZeRO-3
    slices; :mod:`lightning_parallel.hf.loading`). Under Lightning's own strategies the whole folder is read in
    ``configure_model``; outside a Trainer call :meth:`materialize` first. A model from a config alone (a
    ``PretrainedConfig``, or a folder holding only config.json: pretraining from scratch) is built on the meta device
    as well and each rank initializes only what it holds once the model is split, each module by Hugging Face's own
    ``_init_weights`` from a generator seeded by the seed and the module's name (:meth:`CausalLM.materialize`): no
    rank ever holds the whole model, and every layout gets the values one process gets with the same seed.

    MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3: ``config.base_model_ep_plan``) split their experts over ep with HF's
    own router, experts and load-balancing loss (:mod:`lightning_parallel.hf.experts`, docs/hf_moe.md).

    With ``peft_config`` the model is wrapped by peft's ``get_peft_model`` (``self.model`` is the ``PeftModel``: peft's
    modules and parameter names), the base frozen: only the adapters have gradients and optimizer states. LoRA only,
    under ZeRO 0-3, HSDP, tp with or without sequence parallelism, pp (every schedule), cp and ep.

    Args:
        model: a ``PreTrainedModel``, a local folder written by ``save_pretrained`` or a transformers config.
        peft_config: a ``peft.LoraConfig``: train LoRA adapters on a frozen base (the ``peft`` extra).
        adapter_seed: the seed the adapters are initialized from (the global generator is left alone), so every
            process builds the same adapters.
        base_dtype: with ``peft_config``, the dtype the frozen base is kept in (``torch.bfloat16`` or "bf16" /
            "bfloat16", ``torch.float32`` or "fp32" / "float32"); the adapters, their gradients and optimizer
            states stay as loaded (fp32). None: the base as loaded.
        lazy_load: False reads a folder's weights whole in every process, now (``from_pretrained``), and builds a
            model from a config whole on the host, with transformers' own draws (``from_config``). Default: True
            without ``peft_config``; with it the folder is read (or the model built) whole for now.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay, not applied to biases and norm weights (parameters of dimension < 2).
        betas: AdamW betas.
        eps: AdamW epsilon.
    """

    def __init__(
        self,
        model: Any,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        lazy_load: bool | None = None,
        peft_config: Any = None,
        adapter_seed: int = 0,
        base_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        dtype = resolve_base_dtype(base_dtype)
        if dtype is not None and peft_config is None:
            raise ValueError(
                f"HFCausalLM(base_dtype={base_dtype!r}) needs peft_config: only a frozen base is kept in another dtype "
                "than the trained weights. Pass a LoraConfig, or train the whole model in bf16 with precision="
                "'bf16-true' (or 'bf16-mixed')."
            )
        if lazy_load and peft_config is not None:
            msg = "HFCausalLM: lazy_load=True is ignored with peft_config: the folder is read whole for now."
            warnings.warn(msg, stacklevel=2)
        lazy = lazy_causal_lm(model) if lazy_load is not False and peft_config is None else None
        config = config_alone(model) if lazy_load is not False and peft_config is None else None
        if config is not None:  # fresh weights: built on meta, initialized once split (each rank its pieces)
            hf = self.build_on_meta(lambda: fresh_causal_lm(config), hf_init_weights)
        else:
            hf = lazy if lazy is not None else load_causal_lm(model)
        # the folder still to read (None once read), the tied names as built, and what this rank read (bytes)
        self._weights_folder = Path(model) if lazy is not None else None
        self._tied_aliases = tied_aliases(hf) if lazy is not None else {}
        self.weight_bytes_read = 0
        hf_pipeline_layers(hf)  # its family (or its refusal), and the pipeline hooks now: inert under HF's own forward
        self.peft_config = peft_config
        # what adapter checkpoints name the frozen base by (hf/adapters.py), taken before any strategy splits it
        self._base_identity = BaseIdentity(model, hf) if peft_config is not None else None
        self.model = hf if peft_config is None else apply_peft(hf, peft_config, adapter_seed)
        if dtype is not None:
            cast_frozen_base(self.model, dtype)

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model (inside peft's wrapper when there are adapters)."""
        return base_of(self.model)[0]

    @property
    def awaits_materialize(self) -> bool:
        return self._weights_folder is not None or super().awaits_materialize

    def materialize(self, device: torch.device | str = "cpu") -> None:
        """Read the weights of the folder this module was built from into the parameters it holds, on ``device``, or
        initialize a model built from its config alone (:meth:`CausalLM.materialize`): the strategies call it once
        the model is split; nothing to do when the weights are there."""
        if self._weights_folder is None:
            super().materialize(device)
            return
        device = torch.device(device)
        self.weight_bytes_read = load_local_weights(self.model, self._weights_folder, device, self._tied_aliases)
        self._weights_folder = None

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, V) (split over V under tensor parallelism). ``attention_mask`` (B, T): 1 on tokens, 0 on
        padding; ``position_ids`` (B, T): packed documents, positions restarting at each (with no attention mask
        and no cache, transformers' ``create_causal_mask`` keeps every token to its own document)."""
        if self._weights_folder is not None:
            raise RuntimeError(
                f"HFCausalLM's weights from {self._weights_folder} are not read yet: train or test it with a Trainer, "
                "or call .materialize() first (or build it with lazy_load=False)."
            )
        self.require_values(" from its config; or build it with lazy_load=False")
        inputs = {"attention_mask": attention_mask, "position_ids": position_ids}
        out = self.model(input_ids=input_ids, **inputs, use_cache=False)
        # HF's load-balancing loss (None unless config.output_router_logits), added by loss() as HF's forward adds it
        self._router_aux = router_aux_of(out, self.hf_model, attention_mask, self._trainer)
        return out.logits

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """:meth:`CausalLM.loss`, plus HF's load-balancing loss of the forward's routers times
        ``router_aux_loss_coef`` when the config's ``output_router_logits`` asks for it (as HF's own loss)."""
        loss = super().loss(logits, labels)
        aux, self._router_aux = getattr(self, "_router_aux", None), None
        if aux is None and getattr(self, "_pipeline_aux", None) is not None:
            aux = self._pipeline_aux.finish()  # under pp: over every stage's routers
        if aux is None:
            return loss
        return loss + as_loss_like(loss, self.hf_model.router_aux_loss_coef * aux.to(loss.device))

    def on_fit_start(self) -> None:
        """Under pp with HF's load-balancing loss: the stages' exchange of its sums (:mod:`~.hf.moe_pipeline`)."""
        if getattr(self, "_pipeline_aux", None) is not None:
            self._pipeline_aux.close()
        self._pipeline_aux = pipeline_router_aux(self.hf_model, self.trainer.strategy)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if getattr(self, "_pipeline_aux", None) is not None:
            self._pipeline_aux.flush()

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(input_ids, labels, the model's other inputs) of a dict or tuple batch: ``attention_mask`` (padded
        samples) and ``position_ids`` (packed ones) when the dict has them (``document_ids`` is not needed: the
        restarting positions mark the documents)."""
        if isinstance(batch, dict):
            ids = batch["input_ids"]
            inputs = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
            return ids, batch.get("labels", ids), inputs
        ids, labels = batch[0], batch[1]
        return ids, labels, {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[HF_CONFIG_KEY] = self.hf_model.config.to_dict()  # plain values: read back without unpickling code
        if self._base_identity is not None:  # the adapters only: the base is named (every save comes through here)
            skip = self.unsaved_state_keys()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in skip}
            checkpoint[PEFT_KEY] = save_record(self.peft_config, self._base_identity)

    def unsaved_state_keys(self) -> set[str]:
        """The state-dict keys checkpoints leave out: with adapters, all but the trainable ones (the frozen base,
        named by its folder and hash instead); none without."""
        if self._base_identity is None:
            return set()
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        return {name for name in self.state_dict(keep_vars=True) if name not in trainable}

    def check_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse adapters trained on another base (by hash), before anything is loaded.

        Raises:
            ValueError: naming both bases and the fix.
        """
        if self._base_identity is not None and PEFT_KEY in checkpoint:
            check_same_base(checkpoint[PEFT_KEY]["base"], self._base_identity.record())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_checkpoint(checkpoint)
        if self._base_identity is not None and checkpoint.get("state_dict"):
            # a one-file checkpoint under Lightning's own strategies: the base it names is the one this module holds
            # (checked), so it loads back as it is (the mesh strategies leave these keys out of the load instead)
            own = self.state_dict()
            checkpoint["state_dict"].update({k: own[k] for k in self.unsaved_state_keys() if k in own})

    # ----- the parallel protocol (lightning_parallel/protocol.py), read from HF's own plans -----

    def pipeline_layers(self) -> list[nn.Module]:
        return hf_pipeline_layers(self.hf_model)

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        self._sequence_parallel = sequence_parallel  # the strategy asks for the plan before the degrees
        plan = hf_tensor_parallel_plan(self.model, sequence_parallel)
        return {f"model.{path}": style for path, style in plan.items()}

    def context_parallel(self, attention: Any, positions: Any) -> list[str]:
        """Under cp > 1: HF's attention through the attention-function interface, positions per chunk
        (:mod:`lightning_parallel.hf.context`)."""
        prefix = f"model.{base_of(self.model)[1]}"  # under peft the HF model sits at model.base_model.model
        return [prefix + path for path in hf_context_parallel(self.hf_model, attention, positions)]

    def attention_heads(self) -> int:
        return hf_attention_heads(self.hf_model.config)

    def expert_parallel_plan(self) -> dict[str, Any]:
        prefix = f"model.{base_of(self.model)[1]}"
        return {prefix + path: style for path, style in hf_expert_plan(self.hf_model).items()}

    @property
    def family(self) -> HFFamily:
        """The model's :class:`~lightning_parallel.hf.families.HFFamily` (its ``config.model_type``'s entry)."""
        return hf_family(self.hf_model)

    def check_parallel_degrees(self, dims: ParallelDims) -> None:
        if self.peft_config is not None:
            check_peft_degrees(self.peft_config, dims)
        check_hf_degrees(self.hf_model, dims)
        if dims.pp > 1 and dims.tp > 1 and getattr(self, "_sequence_parallel", False):
            raise ValueError(SP_WITH_PP)
